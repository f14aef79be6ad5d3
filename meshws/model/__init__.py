"""Compute: one layer range of a causal LM, its per-session KV caches and sampling.

torch and transformers live here, asyncio and sockets never do. What lives here:
`source` (what `--model` names), `span_cache` (the converted GGUF cache, a part per
layer), `conversion` (its child process), `gguf_file` and `gguf_convert` (a GGUF read a
tensor at a time), `weights` (mapping only a shard's tensors), `memory` (what a process
holds), `shard` (`ModelShard`: prefill and decode over a layer range),
`session_layers` (the cached path and its stateless fallback), `batched` (several
sessions' decode steps as one forward), `cache_store` (`SessionCacheStore`),
`sampling`, `tensors` (hidden states <-> bytes) and `backend` (the `ShardBackend`
protocol and the step types that cross to the transport).

Imports: the standard library, torch, transformers — nothing else of meshws.
"""
