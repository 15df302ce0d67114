"""Serving many users at once: the OpenAI-compatible HTTP edge of the engine (`arlm serve`).

- `api`: FastAPI routes, request validation, text streaming (server-sent events).
- `metrics`: `GET /metrics` in Prometheus' format.
- `cli`: `arlm serve`'s flags, start-up and shutdown.

The engine itself (paged KV pool, scheduler, continuous batching) is `arlm.engine`.
"""
