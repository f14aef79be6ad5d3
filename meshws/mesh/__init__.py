"""Transport: how nodes talk, and the one bridge from asyncio to the model thread.

What lives here: `wire` (every frame and message: the schema), `link` (a persistent
websocket to a next hop, and the pool of them), `shard_service` (`/ws/shard`: the
session channels a middle or tail serves), `compute` (the worker thread that runs
every model call, batching decode steps), `auth` (the mesh secret), `membership`
(a node joining a head), `metrics` and `aio` (small asyncio helpers).

Imports: aiohttp and the standard library, and `meshws.model` only for its step types,
`ShardBackend`, `SamplingParams` and cache errors — never `head`, `api` or `node`.
"""
