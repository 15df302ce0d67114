"""Serving many users at once: a paged KV block pool, continuous batching, an OpenAI-compatible API.

- `block_pool`: block ids, reference counts, prefix hashes (who holds which KV block).
- `paged_cache`: the pool's tensors and paged attention (native kernel, PyTorch fallback).
- `scheduler`: waiting/running queues, chunked prefill, preemption: the tokens of each step.
- `engine`: one step = schedule, one flattened forward pass, per-request sampling; `AsyncEngine`
  runs it on a thread for asyncio callers.
- `api`, `metrics`, `cli`: the HTTP edge (`arlm serve`).
"""
