"""A session's keys and values on a shard: the store (TTL, LRU, a byte budget), the blocks sessions share, and
the rows a standby is fed and keeps. Imports only the boundary (`backend`, `tensors`)."""
