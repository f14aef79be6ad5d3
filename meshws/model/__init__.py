"""Compute: one layer range of a causal LM, its per-session KV caches and sampling.

torch and transformers live here, asyncio and sockets never do. What lives here:
`source` (what `--model` names), `gguf_file` (a GGUF's header and tensor table),
`gguf_model` (the file mapped: tensors as stored, the architecture's facts), `block_types`
(a tensor as stored; which ggml types the kernels compute on), `model_files` (the small
files a GGUF needs: its tokenizer, `tokenizer_files`; a transformers config, `conversion`),
`kernel_build`, `native`, `kernels.c` and `quants.c` (meshws's kernels), `lean`,
`lean_weights`, `packed` and `fused` (the lean path), `shard_parts` and `shard`
(`ModelShard`: prefill and decode over a layer range), `weights` and `gguf_convert` (the
transformers path's weights), `memory` (what a process holds), `session_layers` (the cached
path and its stateless fallback), `batched` (several sessions' steps as one forward),
`cache_store` (`SessionCacheStore`), `sampling`, `tensors` (hidden states <-> bytes) and
`backend` (the `ShardBackend` protocol and the step types that cross to the transport).

Imports: the standard library, torch, transformers — nothing else of meshws.
"""
