"""Compute: one layer range of a causal LM, its per-session KV caches and sampling.

torch and transformers live here, asyncio and sockets never do. What lives here:
`source` (what `--model` names, and the converted GGUF cache), `weights` (reading only
a shard's tensors), `shard` (`ModelShard`: prefill and decode over a layer range),
`session_layers` (the cached path and its stateless fallback), `batched` (several
sessions' decode steps as one forward), `cache_store` (`SessionCacheStore`),
`sampling`, `tensors` (hidden states <-> bytes) and `backend` (the `ShardBackend`
protocol and the step types that cross to the transport).

Imports: the standard library, torch, transformers — nothing else of meshws.
"""
