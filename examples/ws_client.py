#!/usr/bin/env python3
"""Chat with a meshws head over /ws/chat from the terminal, tokens streaming as they come.

    python examples/ws_client.py                       # interactive, http://127.0.0.1:8700
    python examples/ws_client.py --url ws://host:8700 "Tell me a joke"   # one turn, then exit

--url takes the head as people write it: host:port, http(s)://, ws(s)://, with or without /ws/chat.

Ctrl-C sends a stop message (the mesh releases the session) and quits; Ctrl-D quits.
Only needs aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from http import HTTPStatus
from urllib.parse import urlsplit

import aiohttp

SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}


def chat_url(given: str) -> str:
    """The head's /ws/chat address from what a person typed (the page's own URL, the API's, or host:port)."""
    text = given.strip()
    if "://" not in text:
        text = "ws://" + text
    parts = urlsplit(text)
    if parts.scheme not in SCHEMES or not parts.netloc:
        raise ValueError(f"--url {given!r} is not a head's address (for example ws://127.0.0.1:8700)")
    path = parts.path.rstrip("/")
    for suffix in ("/ws/chat", "/v1"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return f"{SCHEMES[parts.scheme]}://{parts.netloc}{path}/ws/chat"


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "(an unknown status)"


async def turn(ws: aiohttp.ClientWebSocketResponse, messages: list[dict], args: argparse.Namespace) -> str:
    request = {"type": "chat", "messages": messages, "max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        request["seed"] = args.seed
    await ws.send_str(json.dumps(request))
    text = []
    try:
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                raise SystemExit("the head closed the connection")
            data = json.loads(message.data)
            if data["type"] == "delta":
                text.append(data["text"])
                print(data["text"], end="", flush=True)
            elif data["type"] == "done":
                timing = data["timing"]
                print(f"\n[{data['finish_reason']}; {data['usage']['completion_tokens']} tokens, "
                      f"first token {timing['ttft_ms']} ms, {timing['tokens_per_second']} tok/s]", file=sys.stderr)
                return "".join(text)
            elif data["type"] == "error":
                print(f"\n[error: {data['message']}]", file=sys.stderr)
                return "".join(text)
    except asyncio.CancelledError:
        await ws.send_str(json.dumps({"type": "stop"}))
        raise
    return "".join(text)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", help="one message to send; without it, chat interactively")
    parser.add_argument("--url", default="ws://127.0.0.1:8700", help="the head's address")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--system", default=None, help="a system prompt")
    parser.add_argument("--api-key", default=None, help="the head's --api-key, if it has one")
    args = parser.parse_args()
    try:
        url = chat_url(args.url)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    async with aiohttp.ClientSession() as session:
        try:
            ws = await session.ws_connect(url, headers=headers)
        except aiohttp.WSServerHandshakeError as exc:
            hint = "; give the head's --api-key with --api-key" if exc.status == 401 else ""
            raise SystemExit(f"{url} answered {exc.status} {_phrase(exc.status)}{hint}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise SystemExit(f"cannot reach the head at {url}: {exc}") from None
        async with ws:
            if args.prompt:
                await turn(ws, messages + [{"role": "user", "content": args.prompt}], args)
                return
            while True:
                try:
                    line = await asyncio.to_thread(input, "> ")
                except (EOFError, KeyboardInterrupt):
                    return
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line})
                messages.append({"role": "assistant", "content": await turn(ws, messages, args)})


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
