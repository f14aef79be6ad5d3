"""Compute: one layer range of a causal LM, its per-session KV caches and sampling.

torch lives here, asyncio and sockets never do. Four rooms, and the compute that uses them:

  gguf/     a GGUF file: its table, its blocks mapped, its tokenizer and config built into a cache folder
  text/     tokens and choices: a tokenizer folder read, sampling and its settings, structured output's masks
  kv/       a session's keys and values: the store with its budget, the blocks, the copies a standby keeps
  kernels/  meshws's C kernels: built, loaded, and the linears, paths and fused steps on them

Directly here: `shard` (`ModelShard`: prefill and decode over a layer range) and what it is made of
(`shard_parts`, `lean`, `lean_weights`, `weights`, `session_layers`, `batched`, `compiled`), what a shard
tells (`shard_facts`, `costs`, `speed`, `memory`), `source` (what `--model` names), `settings`, and the
boundary the transport meets: `backend` (the protocol and step types, no torch) and `tensors` (hidden
states <-> bytes).

Directions (`tests/test_architecture.py`): a room imports only its own modules, the rooms before it in
the order gguf, text, kv, kernels, and the boundary (`backend`, `tensors`); the modules here import any
room. Nothing of meshws outside `model` is imported.
"""
