"""The head's own logic: generations, routes, the registry of joined nodes, and text.

What lives here: `generation` (the generation loop over a session channel, with
re-prefill and failover), `planner` and `routes` (which nodes a generation goes
through), `registry` and `membership` (joined nodes and the `/mesh/*` endpoints),
`text_stream` (token ids -> streamed text, stop strings), `prompts` (chat messages ->
a prompt) and `service` (`HeadService`: the one object the public surfaces use).

Imports: `meshws.mesh` and `meshws.model` — never `api` or `node`.
"""
