"""meshws's C kernels: built for this CPU, loaded, and the lean path's linears, product paths and fused decode
step on them; which library multiplies float weights and who gets the threads. Imports the `gguf` and `kv`
rooms (block types, KV blocks) and nothing else of `model`."""
