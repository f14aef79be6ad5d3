"""The links of one node: one per next-hop URL, dialed on first use (or offered by a peer that dials in), reused
by every session, closed when idle or when the hop leaves the mesh."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from .link import Link


class LinkPool:
    """The links of one node, one per next-hop URL, dialed on first use and then reused."""

    def __init__(self, factory: Callable[[str], Link]) -> None:
        self._factory = factory
        self._links: dict[str, Link] = {}

    def get(self, url: str) -> Link:
        url = url.rstrip("/")
        link = self._links.get(url)
        if link is None:
            link = self._factory(url)
            self._links[url] = link
            link.start()
        return link

    def all(self) -> list[Link]:
        return list(self._links.values())

    def __contains__(self, url: str) -> bool:
        return url.rstrip("/") in self._links

    def close_idle(self, idle_seconds: float, keep: set[str]) -> list[str]:
        """Close links no session has used for `idle_seconds` (except those in `keep`, and reversed ones while their
        peer's socket is up: it would only dial in again); their URLs."""
        now = time.monotonic()
        idle = [url for url, link in self._links.items() if url not in keep and not (link.reversed and link.is_up)
                and link.sessions == 0 and now - link.last_used > idle_seconds]
        for url in idle:
            self.discard(url)
        return idle

    def discard(self, url: str) -> None:
        """Forget a next hop (it left the mesh): close its link in the background."""
        link = self._links.pop(url.rstrip("/"), None)
        if link is not None:
            asyncio.ensure_future(link.close())

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()
