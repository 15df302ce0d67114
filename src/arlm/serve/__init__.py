"""Serving many users at once: the HTTP edge of the engine (`arlm serve`), speaking OpenAI's and
Anthropic's protocols.

- `transport`, `schemas`, `errors`: the edge every protocol shares (auth, body limit, validation,
  SSE; request schemas and limits; errors naming the field).
- `sampling_fields`: a request's fields as the engine's `SamplingParams` and structured output.
- `common`: `Server`, the steps of a request in order, and the typed turn (`Job`, `Delta`, `Reply`).
- the protocols: `openai_completions`, `openai_chat` (with `choices`), `responses`, `anthropic`,
  `embeddings`, `tokens`.
- `api`: the app (routes, error shapes); `metrics`: `GET /metrics` in Prometheus' format.
- `build`: the server the flags describe; `cli`: `arlm serve`; `cluster`: replicas on Ray Serve.

The engine itself (paged KV pool, scheduler, continuous batching) is `arlm.engine`.
"""
