"""`kvstrata serve`: an OpenAI-compatible HTTP server whose sessions live in the persistent KV store.

Layers: above `place` (the store, `PrefixServer`) and `bench`, below `cli`. Modules, edge to core:
`app` (routes, SSE), `schemas` (request validation), `auth` (API keys, tenant salt), `prompts`
(tokenizer, chat template, context checks), `worker` (the model worker: batched steps, bounded
queue), `scheduler` (admission under the KV budget, which rows share a step),
`sampling`, `text` (stop sequences, streaming deltas), `sessions` (prompts through the store),
`write_behind` (writes off the first-token path, retention classes), `metrics` (Prometheus),
`server` (assembly), `process` (a server subprocess), `bench` (`kvstrata serve-bench`).
"""

from kvstrata.serve.config import ServeConfig

__all__ = ["ServeConfig"]
