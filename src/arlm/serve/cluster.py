"""`arlm serve --replicas N`: the same HTTP API from N replicas of the server on a Ray cluster.

Ray Serve runs the application (`pip install 'arlm[cluster]'`: ray[serve]); nothing here is a
cluster layer of arlm's own:

- `EngineReplica` (a deployment of N replicas, `--threads-per-replica` CPUs each, placed by Ray
  across the cluster's nodes): one whole arlm server each — its model, `AsyncEngine` and KV pool,
  and the app of api.py, every route with its validation, auth and error shapes. A request
  reaches the app as ASGI messages (`handle`), its response goes back message by message, so a
  stream is token by token through the ingress; a request abandoned upstream is cancelled in the
  app, which aborts it in the engine and frees its blocks.
- `Ingress` (one replica, Ray Serve's HTTP proxy in front): forwards each request to a replica
  through a deployment handle whose request router is `PrefixRouter`, and streams the answer back.
- `PrefixRouter` (Ray Serve's `RequestRouter` API): sends a request to the replica that most
  recently served the longest prefix of its prompt text (chained hashes of PREFIX_CHARS-character
  chunks: a replica that served it holds its KV blocks in its prefix cache), unless that replica's
  queue is longer than the shortest by more than `imbalanced_threshold`: then to the least loaded
  (Ray's own probing among all replicas). Multi-turn chats and agents re-sending a long system
  prompt land where their blocks are.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, AsyncIterator

from ray import serve
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # (Ray's default, not exported)
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..settings import MAX_ONGOING_REQUESTS

PREFIX_CHARS = 256  # characters per hashed chunk of a prompt's text


def unavailable(message: str, code: str) -> dict:
    """The ingress's own errors, in OpenAI's error shape (errors.error_response's; errors imports
    the engine and torch, which the ingress process never loads)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def prompt_text(body: bytes) -> str:
    """The text a request's prompt starts with, as its protocol gives it (system or instructions
    first, then the messages' or input's text); "" where there is none."""
    try:
        req = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(req, dict):
        return ""
    parts: list[str] = []

    def add(x: Any) -> None:
        if isinstance(x, str):
            parts.append(x)
        elif isinstance(x, list):
            for item in x:
                add(item.get("content", item.get("text", item.get("output"))) if isinstance(item, dict) else item)

    for key in ("system", "instructions", "messages", "input", "prompt"):
        add(req.get(key))
    return "\x00".join(parts)


def prefix_hashes(text: str) -> list[str]:
    """Chained hashes of the text's whole PREFIX_CHARS-character chunks: equal hashes, equal prefixes."""
    out, h = [], b""
    for i in range(0, len(text) - PREFIX_CHARS + 1, PREFIX_CHARS):
        h = hashlib.blake2b(h + text[i:i + PREFIX_CHARS].encode(), digest_size=8).digest()
        out.append(h.hex())
    return out


class Addressed:
    """For both routers: a request that names a replica (the `replica` keyword: its id) goes to
    it — the ingress reads each replica's /metrics so —, and the replicas' ids are kept where the
    ingress reads them (router_stats.REPLICAS)."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.replicas_changed()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # (Ray drops it from curr_replicas)
        self.replicas_changed()

    def replicas_changed(self) -> None:
        from arlm.serve.router_stats import REPLICAS

        REPLICAS[:] = sorted(r.unique_id for r in self.curr_replicas)
        self.forget(set(self.curr_replicas))

    def forget(self, alive: set) -> None:
        """Drop what the router keeps of replicas no longer running (the prefix router's state)."""

    @staticmethod
    def addressed(candidates: list[RunningReplica], pending: PendingRequest | None) -> list[RunningReplica] | None:
        """[the replica the request names], or every candidate while that one is gone (the answer
        says which replica gave it); None if the request names none. (Never an empty rank: Ray
        would ask again at once, without backing off.)"""
        want = pending.kwargs.get("replica") if pending is not None else None
        if want is None:
            return None
        return [r for r in candidates if r.replica_id.unique_id == want] or candidates


class PowerOfTwoRouter(Addressed, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router (two replicas at random, the shorter queue), for comparison."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if (named := self.addressed(candidate_replicas, pending_request)) is not None:
            return [named]
        return await super().choose_replicas(candidate_replicas, pending_request)


class PrefixRouter(Addressed, RequestRouter):
    """Prefix-aware routing over Ray Serve's request router (the module doc). It picks the
    replica itself (the first rank holds one; the others follow should it refuse the request), so
    that it knows where each prefix went; the load it weighs is its requests not completed, each
    counted once: on the replica it was chosen for, then on the one Ray routed it to (another when
    the chosen one missed Ray's queue-length probe deadline, as on a loaded machine: counted where
    chosen, the chosen one's count grew for ever and it got nothing). No FIFOMixin: with it Ray
    hands a chosen replica to the oldest request waiting, not to the one it was chosen for;
    without it, to that one."""

    def initialize_state(self, imbalanced_threshold: int = 4, max_prefixes: int = 8192) -> None:
        self.imbalanced_threshold = imbalanced_threshold
        self.max_prefixes = max_prefixes
        self.recent: dict[ReplicaID, OrderedDict[str, None]] = {}
        self.placed: dict[str, tuple[ReplicaID, PendingRequest]] = {}  # request id -> where it counts
        self.outstanding: Counter[ReplicaID] = Counter()

    def place(self, pending: PendingRequest, replica_id: ReplicaID) -> None:
        self.unplace(pending.metadata.internal_request_id)
        self.placed[pending.metadata.internal_request_id] = (replica_id, pending)
        self.outstanding[replica_id] += 1

    def unplace(self, request_id: str) -> None:
        if (entry := self.placed.pop(request_id, None)) is not None:
            self.outstanding[entry[0]] -= 1

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas or pending_request is None:
            return [candidate_replicas]
        for request_id in [i for i, (_, p) in self.placed.items() if p.future.cancelled()]:
            self.unplace(request_id)  # (left before it was sent: no completion comes)
        if (named := self.addressed(candidate_replicas, pending_request)) is not None:
            if len(named) == 1:  # (counted as any other: its completion is; else it is not yet placed)
                self.place(pending_request, named[0].replica_id)
            return [named]
        keyed = pending_request.kwargs.get("prefix") is not None  # (None: not a request with a prompt: a GET)
        hashes = pending_request.kwargs.get("prefix") or []
        # (this process's counts: the class may have come pickled by value, its globals a copy)
        from arlm.serve.router_stats import COUNTS as ROUTER_COUNTS

        def matched(r: RunningReplica) -> int:
            seen = self.recent.get(r.replica_id, {})
            n = 0
            while n < len(hashes) and hashes[n] in seen:
                n += 1
            return n

        load = {r.replica_id: self.outstanding[r.replica_id] for r in candidate_replicas}
        # the least loaded; among equals the one holding the fewest prefixes (new conversations spread)
        least = min(candidate_replicas, key=lambda r: (load[r.replica_id], len(self.recent.get(r.replica_id, ()))))
        best = max(candidate_replicas, key=matched) if hashes else least
        chosen = least
        if not hashes:
            ROUTER_COUNTS["no_prefix"] += keyed
        elif matched(best) and load[best.replica_id] - load[least.replica_id] > self.imbalanced_threshold:
            ROUTER_COUNTS["fallbacks"] += 1
        elif matched(best):
            ROUTER_COUNTS["prefix_hits"] += 1
            chosen = best
        seen = self.recent.setdefault(chosen.replica_id, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.max_prefixes:
            seen.popitem(last=False)
        self.place(pending_request, chosen.replica_id)
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        # (only a request still placed: Ray registers the completion callback before it awaits the
        # replica's acceptance and calls this, and a quick answer — a 400, a /metrics page — can
        # complete in between; placed again, it counted on that replica for ever, which then got
        # fewer requests than it should: two streams on one replica while the other stood idle)
        if pending_request.metadata.internal_request_id in self.placed:
            self.place(pending_request, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.unplace(internal_request_id)

    def forget(self, alive: set) -> None:
        for gone in [r for r in getattr(self, "recent", {}) if r not in alive]:
            del self.recent[gone]
        for request_id in [i for i, (r, _) in getattr(self, "placed", {}).items() if r not in alive]:
            self.unplace(request_id)


@serve.deployment
class EngineReplica:
    """One whole arlm server (build.build_server) behind ASGI calls from the ingress."""

    def __init__(self, args, config) -> None:
        import torch

        from .api import create_app
        from .build import build_server

        from ..runtime import runtime

        # The model loads on this thread with one OpenMP thread, the engine's thread then steps at
        # the replica's width. An OpenMP team on this thread too would make libgomp manage more
        # threads than the replica's cores, and then its threads sleep at every barrier instead of
        # spinning (docs/benchmarks.md, "Replicas on Ray Serve": 0.42 -> 0.67 of one process at 1 client).
        torch.set_num_threads(args.threads_per_replica)
        runtime().threads  # noqa: B018 - (the governor, made now: at the replica's width)
        torch.set_num_threads(1)
        self.server = build_server(args, config)
        torch.set_num_threads(args.threads_per_replica)
        self.app = create_app(self.server, engine_thread=True)
        self.started = False
        import ray

        self.names = [(b"x-arlm-replica", str(os.getpid()).encode()),
                      (b"x-arlm-replica-id", serve.get_replica_context().replica_id.unique_id.encode()),
                      (b"x-arlm-node", ray.util.get_node_ip_address().encode()),
                      (b"x-arlm-node-id", ray.get_runtime_context().get_node_id()[:12].encode())]

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                     prefix: list[str] | None = None, replica: str | None = None) -> AsyncIterator[dict]:
        """One HTTP request through the app: its response as ASGI messages (start, body chunks).
        (`prefix` and `replica` are for the router.)"""
        if not self.started:  # the engine's loop, on this replica's event loop (the app's lifespan's work)
            self.server.engine.start(asyncio.get_running_loop())
            self.started = True
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
                 "headers": headers, "client": ("ingress", 0), "server": ("replica", 0)}
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":  # which replica answered (its process, its id)
                message = {**message, "headers": [*message.get("headers", []), *self.names]}
            await messages.put(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await messages.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await messages.get()) is not None:
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    break
        finally:  # the client left, or the response ended: the app's request ends too
            gone.set()
            if not task.done():
                await asyncio.wait({task}, timeout=5)
                task.cancel()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
class Ingress:
    """The HTTP front: each request to a replica chosen by `PrefixRouter`, streamed back."""

    def __init__(self, replica, replicas: int) -> None:
        self.replica = replica.options(stream=True)
        self.replicas = replicas  # /health is 503 "degraded" while fewer run (--replicas N, or --min-replicas)
        self.streams: set = set()  # the replicas' answers being relayed
        self.draining = False  # drain(): new requests refused
        self.cut = False  # a drain's time is up: the streams left are ended

    async def drain(self, timeout: float) -> int:
        """Stop taking requests, let the streams running finish for up to `timeout` seconds, then
        end the rest with an error event; returns how many had to be ended."""
        self.draining = True
        deadline = asyncio.get_running_loop().time() + timeout
        while self.streams and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        left = len(self.streams)
        self.cut = True
        for stream in list(self.streams):  # (each relay then says so and ends)
            stream.cancel()
        deadline = asyncio.get_running_loop().time() + 5  # (an answer whose client left before it
        while self.streams and asyncio.get_running_loop().time() < deadline:  # began is never relayed)
            await asyncio.sleep(0.05)
        return left

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        if self.draining:
            return JSONResponse(unavailable("the server is shutting down", "draining"), 503)
        body = await request.body()
        if request.url.path == "/metrics":  # the router's decisions beside a replica's metrics
            return await self._metrics(request, body)
        if request.url.path == "/health" and (running := self.running()) < self.replicas:
            return JSONResponse(unavailable(f"degraded: {running} of {self.replicas} replicas running", "degraded"), 503)
        hashes = prefix_hashes(prompt_text(body)) if request.method == "POST" else None
        args = (request.method, request.url.path, request.url.query.encode(),
                [(k.encode(), v.encode()) for k, v in request.headers.items()], body)
        for attempt in (1, 2):  # a request that had not started on a replica that died: once more, elsewhere
            stream = self.replica.handle.remote(*args, prefix=hashes)
            self.streams.add(stream)  # (a drain waits for an answer not begun too: a whole one comes at its end)
            try:
                start = await stream.__anext__()
                break
            except Exception as e:  # noqa: BLE001 - the replica's actor died or became unreachable, or the drain's time is up
                self.streams.discard(stream)
                if self.cut:
                    return JSONResponse(unavailable("the server is shutting down: this request was ended (drain "
                                                    "timeout)", "draining"), 503)
                if attempt == 2:
                    return JSONResponse(unavailable(f"no replica could take the request: {type(e).__name__}",
                                                    "replica_lost"), 503)
            except BaseException:  # (the client left while it waited)
                self.streams.discard(stream)
                stream.cancel()
                raise
        headers = {k.decode(): v.decode() for k, v in start.get("headers", []) if k.lower() != b"content-length"}
        sse = headers.get("content-type", "").startswith("text/event-stream")

        def error(message: str, code: str) -> bytes:
            return f"data: {json.dumps(unavailable(message, code))}\n\ndata: [DONE]\n\n".encode() if sse else b""

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for message in stream:
                    if message["type"] == "http.response.body" and message.get("body"):
                        yield message["body"]
            except Exception as e:  # noqa: BLE001 - the drain's time is up (its cancel), or the replica died
                if self.cut:  # mid-answer: either is said, never a silent cut
                    yield error("the server is shutting down: this stream was ended (drain timeout)", "draining")
                else:
                    yield error(f"the replica serving this stream was lost ({type(e).__name__})", "replica_lost")
            finally:
                self.streams.discard(stream)
                stream.cancel()

        return StreamingResponse(chunks(), status_code=start["status"], headers=headers)

    def running(self) -> int:
        """Replicas of the engine deployment running now (Ray Serve's controller says)."""
        try:
            app = serve.status().applications["arlm"]
            deployment = next(d for name, d in app.deployments.items() if "EngineReplica" in name)
            return int(deployment.replica_states.get("RUNNING", 0))
        except Exception:  # noqa: BLE001 - a status that cannot be read is not a healthy one
            return 0

    async def _metrics(self, request, body: bytes):
        """Every replica's metrics, each sample labelled with its replica, and the router's."""
        from starlette.responses import PlainTextResponse

        from arlm.serve.router_stats import COUNTS as ROUTER_COUNTS, REPLICAS

        from .metrics import render_replicas

        pages: dict[str, tuple[str, dict[str, str]]] = {}  # replica id -> (its page, where it runs)
        if not REPLICAS:  # (the router learns the replicas with its first request)
            await self._replica_metrics(None, pages)
        silent: set[str] = set()  # replicas that did not answer in time: not asked again
        for _ in range(3):  # (a page from another replica than asked: asked again)
            if not (missing := [r for r in REPLICAS if r not in pages and r not in silent]):
                break
            for r in missing:  # (one at a time: calls from one request share its id, which Ray's
                if not await self._replica_metrics(r, pages):  # router matches them by: at once,
                    silent.add(r)  # one would wait for ever)
        text = render_replicas(pages, ROUTER_COUNTS, PREFIX_CHARS)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _replica_metrics(self, replica: str | None, pages: dict) -> bool:
        """One replica's /metrics into `pages` under the id it answers with; False if no answer came."""
        async def fetch() -> None:
            names, text = {}, b""
            async for message in self.replica.handle.remote("GET", "/metrics", b"", [], b"", replica=replica):
                names = names or {k.decode(): v.decode() for k, v in message.get("headers", [])}
                text += message.get("body", b"")
            pages[names["x-arlm-replica-id"]] = (text.decode(), {
                "pid": names["x-arlm-replica"], "node": names["x-arlm-node"], "node_id": names["x-arlm-node-id"]})

        try:
            await asyncio.wait_for(fetch(), timeout=2)
            return True
        except Exception as e:  # noqa: BLE001 - a replica lost or restarting: the page has the others
            logging.getLogger("ray.serve").warning("arlm: no metrics from replica %s: %r", replica, e)
            return False


def serve_replicated(args, config) -> int:
    """Start (or join: --ray-address) a Ray cluster and run the application until a signal."""
    import ray
    from ray.serve.config import RequestRouterConfig

    auto = args.replicas == "auto"
    fewest = args.min_replicas if auto else args.replicas
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=False,  # (a local instance:
             # the replicas asked for fit, on fewer cores than they ask if need be, rather than wait for ever)
             **({} if args.ray_address else {"num_cpus": max(os.cpu_count() or 1, fewest * args.threads_per_replica)}))
    router = RequestRouterConfig(request_router_class="arlm.serve.cluster:PrefixRouter",
                                 request_router_kwargs={"imbalanced_threshold": 4}) \
        if args.replica_router == "prefix" else RequestRouterConfig(request_router_class="arlm.serve.cluster:PowerOfTwoRouter")
    if auto:  # Ray Serve's autoscaler: replicas added while they serve more than the target each, removed below it
        cpus = int(ray.cluster_resources().get("CPU", 1))
        top = args.max_replicas or max(args.min_replicas, cpus // args.threads_per_replica)
        target = args.target_ongoing_requests or min(max(1, args.max_num_seqs // 2), MAX_ONGOING_REQUESTS)
        count = {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": args.min_replicas, "max_replicas": top, "target_ongoing_requests": target}}
        shown = f"{args.min_replicas}..{top} replicas (autoscaled, {target:g} requests each)"
    else:
        count, shown = {"num_replicas": args.replicas}, f"{args.replicas} replica(s)"
    # (a replica stopped by the autoscaler or a redeploy: its requests get --drain-timeout, at least
    # a minute, to finish; Ray's default of 20 s cuts a long generation)
    replicas = EngineReplica.options(**count,
                                     ray_actor_options={"num_cpus": args.threads_per_replica,
                                                        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(args.threads_per_replica)}}},
                                     request_router_config=router, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                                     graceful_shutdown_timeout_s=max(60.0, args.drain_timeout))
    if (failed := deploy(Ingress.bind(replicas.bind(args, config), fewest), args)) is not None:
        print(f"arlm serve: {failed}", file=sys.stderr, flush=True)
        stop(args)
        return 1
    print(f"arlm serve: model {args.served_model_name or args.model} on {shown} x "
          f"{args.threads_per_replica} thread(s) of Ray Serve, routed by "
          f"{'prompt prefix' if args.replica_router == 'prefix' else 'power of two choices'}; listening on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        pass
    # drain: no new requests, the running streams finish (or end with an error event at the timeout)
    try:
        ended = serve.get_app_handle("arlm").drain.remote(args.drain_timeout).result(timeout_s=args.drain_timeout + 30)
        print(f"arlm serve: drained ({ended} request(s) ended at the {args.drain_timeout:g} s timeout); stopping",
              file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - the ingress lost or stuck: stop all the same
        print(f"arlm serve: the drain did not complete ({type(e).__name__}); stopping", file=sys.stderr, flush=True)
    serve.delete("arlm")
    stop(args)
    return 0


def deploy(app, args) -> str | None:
    """Start Ray Serve and the application; None once its HTTP proxy and every replica run, else
    why not, in a line. Each is a Ray worker process that imports Ray before it runs (and a replica
    loads its model): on a loaded machine that takes tens of seconds, more than Serve's controller
    gives the proxy (three readiness checks of RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, 5 s: then it
    kills the proxy, never run, and serve.start fails) or serve.start waits for it (60 s). Both are
    sized to --replica-start-timeout here, and so is the wait for the replicas (none of Serve's)."""
    import ray
    from ray.serve.config import HTTPOptions
    from ray.serve.schema import ApplicationStatus, ProxyStatus

    timeout = args.replica_start_timeout
    deadline = time.monotonic() + timeout

    def late(what: str) -> str:
        return (f"{what} {'was' if what == 'the HTTP proxy' else 'were'} not running after {timeout:g} s: raise "
                f"--replica-start-timeout (a loaded machine or a large model needs more)")

    knobs = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": f"{timeout / 3:g}"}  # (the controller's: a new one's only)
    try:
        serve.start(http_options=HTTPOptions(host=args.host, port=args.port),
                    controller_options={"runtime_env": {"env_vars": knobs}})
    except TimeoutError:  # (serve.start's own 60 s for the proxy: the controller goes on starting it)
        pass
    except ray.exceptions.RayActorError:  # (the controller gave up on the proxy: our time is up)
        return late("the HTTP proxy")
    serve.run_many([serve.RunTarget(app, name="arlm", route_prefix="/")], wait_for_applications_running=False)
    while True:
        status = serve.status()
        state = status.applications.get("arlm")
        proxy = bool(status.proxies) and all(p == ProxyStatus.HEALTHY for p in status.proxies.values())
        replicas = state is not None and state.status == ApplicationStatus.RUNNING
        if state is not None and state.status == ApplicationStatus.DEPLOY_FAILED:
            return f"the replicas failed to start: {(state.message.strip() or 'no reason given').splitlines()[-1]}"
        if proxy and replicas:
            return None
        if time.monotonic() > deadline:
            return late(" and ".join(["the HTTP proxy"] * (not proxy) + ["the replicas"] * (not replicas)))
        time.sleep(0.5)


def stop(args) -> None:
    """Stop Serve and the local Ray instance this process began (a joined cluster goes on)."""
    import ray

    if not args.ray_address:
        serve.shutdown()
        ray.shutdown()

