"""The mesh secret: only nodes that know it may link to a node or join a head.

Every link dial and every /mesh request carries the header
`X-Meshws-Auth: <unix time>.<nonce>.<HMAC-SHA256(secret, "<time>.<nonce>.<path>")>`,
checked before a websocket is upgraded or a join is read. The secret itself
never travels; a header is good for one path, for `MAX_SKEW` seconds, and only
once (nonces are remembered for that long), so a captured header cannot be
replayed elsewhere or later. Why a header and not a challenge inside `hello`:
the same check then guards plain HTTP joins, and a refused peer never gets as
far as a websocket, let alone a session. The secret proves membership; it does
not encrypt traffic: put links on a private network or behind TLS (wss://).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from typing import Callable

HEADER = "X-Meshws-Auth"
MAX_SKEW = 120.0  # seconds a header stays valid (clocks of nodes may differ this much)


def sign(secret: str, path: str, now: float | None = None) -> str:
    stamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(12)
    return f"{stamp}.{nonce}.{_mac(secret, stamp, nonce, path)}"


def _mac(secret: str, stamp: str, nonce: str, path: str) -> str:
    return hmac.new(secret.encode(), f"{stamp}.{nonce}.{path}".encode(), hashlib.sha256).hexdigest()


class Verifier:
    """Checks auth headers; remembers recent nonces so a header works once."""

    def __init__(self, secret: str | None, clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def check(self, header: str | None, path: str) -> str | None:
        """None when the header is good (or no secret is set), else why not."""
        if not self.secret:
            return None
        if not header:
            return f"missing {HEADER} header (this mesh needs its secret)"
        parts = header.split(".")
        if len(parts) != 3 or not parts[0].isdigit():
            return f"malformed {HEADER} header"
        stamp, nonce, mac = parts
        now = self._clock()
        if abs(now - int(stamp)) > MAX_SKEW:
            return f"{HEADER} header is too old or from the future (check the clocks)"
        if not hmac.compare_digest(mac, _mac(self.secret, stamp, nonce, path)):
            return "wrong mesh secret"
        while self._seen and next(iter(self._seen.values())) < now - 2 * MAX_SKEW:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return f"{HEADER} header was already used (replay)"
        self._seen[nonce] = now
        return None
