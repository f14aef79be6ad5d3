"""Public surfaces of a head: the OpenAI-compatible API, `/ws/chat` and the chat page.

What lives here: `requests` (validating a request body into a `CompletionSpec`),
`errors` (OpenAI-shaped errors, the API key middleware), `openai_routes`
(`/v1/*`), `chat_ws` (`/ws/chat`) and `page` (the chat page from `web/`).

Imports: `meshws.head` (through `HeadService`) and the model's `SamplingParams` —
never `node`. Nothing here touches a link, a shard or the registry.
"""
