"""The mesh secret: only nodes that know it may link to a node, join a head or read its details.

A request proves it with the header
`X-Meshws-Auth: <unix time>.<nonce>.<HMAC-SHA256(secret, time, nonce, method, path, SHA-256(body))>`
where the nonce was handed out a moment before by the very node it is for
(`GET /mesh/challenge`). So a header is good for one request, one node, one body and
one use: captured on the way to node A it opens nothing on node B (B never issued that
nonce), nor on A again (the nonce is spent), nor for another body or path. Transparent
forwarders (port forwards, SSH tunnels, relays) carry both requests unchanged, so links
work through them. The secret itself never travels.

The same secret signs the route a head sends in `open` (`sign_route`), so a middle
only dials hops a head chose.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable

import orjson

from .identity import HEADER as identity_header, is_key

HEADER = "X-Meshws-Auth"
CHALLENGE_PATH = "/mesh/challenge"
MAX_SKEW = 120.0  # seconds a nonce stays valid, and how far clocks may differ
_HEADER_FORM = re.compile(r"^(\d{1,12})\.([0-9a-f]{8})([0-9a-f]{16})([0-9a-f]{32})\.([0-9a-f]{64})$")


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(secret: str, *parts: str) -> str:
    return hmac.new(secret.encode(), "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def sign(secret: str, nonce: str, method: str, path: str, body: bytes = b"", now: float | None = None) -> str:
    """The header for one request to the node that handed out `nonce`."""
    stamp = str(int(time.time() if now is None else now))
    return f"{stamp}.{nonce}.{_mac(secret, stamp, nonce, method.upper(), path, body_digest(body))}"


def sign_route(secret: str, sid: str, route: Iterable[dict[str, Any]]) -> str:
    """The MAC a head puts on a session's route; every hop checks it before dialing."""
    return _mac(secret, "route", sid, orjson.dumps(list(route), option=orjson.OPT_SORT_KEYS).decode())


def route_is_signed(secret: str, sid: str, route: Iterable[dict[str, Any]], mac: str | None) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(mac, sign_route(secret, sid, route))


class Verifier:
    """Hands out nonces and checks headers against them; each nonce works once, here, for a while.

    A nonce is `<issue time><random><this node's MAC of both>`: the node keeps no state
    for nonces it hands out (a flood of `/mesh/challenge` costs nothing and evicts
    nothing), and remembers only the nonces used within the last `MAX_SKEW` seconds —
    which only holders of the secret can add to.
    """

    def __init__(self, secret: str | None, clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self._clock = clock
        self._key = secrets.token_hex(16)  # this node's own: a nonce made here is valid nowhere else
        self._used: OrderedDict[str, float] = OrderedDict()  # nonce -> when it was used

    def challenge(self) -> str:
        """A fresh nonce for one signed request to this node."""
        issued = f"{int(self._clock()) & 0xFFFFFFFF:08x}"
        rand = secrets.token_hex(8)
        return issued + rand + _mac(self._key, "nonce", issued, rand)[:32]

    def check(self, header: str | None, method: str, path: str, body: bytes = b"") -> str | None:
        """None when the header is good (or no secret is set), else why not."""
        problem = self.precheck(header)
        if problem or not self.secret:
            return problem
        stamp, issued, rand, tag, mac = _HEADER_FORM.match(header).groups()  # type: ignore[union-attr]
        nonce = issued + rand + tag
        if not hmac.compare_digest(mac, _mac(self.secret, stamp, nonce, method.upper(), path, body_digest(body))):
            return "wrong mesh secret"
        now = self._clock()
        while self._used and next(iter(self._used.values())) < now - 2 * MAX_SKEW:
            self._used.popitem(last=False)
        if nonce in self._used:
            return f"{HEADER} header was already used (replay)"
        self._used[nonce] = now
        return None

    def precheck(self, header: str | None) -> str | None:
        """What can be checked before reading a body: form, time, and that this node made the nonce."""
        if not self.secret:
            return None
        if not header:
            return f"missing {HEADER} header (this mesh needs its secret)"
        match = _HEADER_FORM.match(header) if len(header) < 200 else None
        if match is None:
            return f"malformed {HEADER} header"
        stamp, issued, rand, tag, _ = match.groups()
        now = self._clock()
        if abs(now - int(stamp)) > MAX_SKEW:
            return f"{HEADER} header is too old or from the future (check the clocks)"
        if not hmac.compare_digest(tag, _mac(self._key, "nonce", issued, rand)[:32]):
            return f"{HEADER} header names a nonce this node did not hand out"
        if (int(now) - int(issued, 16)) & 0xFFFFFFFF > MAX_SKEW:
            return f"{HEADER} header names a nonce that has expired"
        return None


def http_base(url: str) -> str:
    """ws://host:port -> http://host:port (wss -> https): where a node's HTTP endpoints are."""
    if url.startswith("ws://"):
        return "http://" + url[len("ws://"):]
    if url.startswith("wss://"):
        return "https://" + url[len("wss://"):]
    return url


def listener_proof(secret: str, asked: str, nonce: str) -> str:
    """What a node answers to a challenge to show it knows the secret too."""
    return _mac(secret, "listener", asked, nonce)


async def signed_headers(client: Any, base: str, secret: str | None, method: str, path: str,
                         body: bytes = b"", ssl: Any = True, identity: Any = None,
                         peer_key: str | None = None) -> dict[str, str]:
    """Ask the node at `base` for a nonce (and its proof of the secret) and sign one request to it; with this node's
    `identity` (`mesh.identity.NodeIdentity`), its key's signature of the same request, for the key the challenge
    names, as well. `peer_key`: the key that node must name (as its head named it), else nothing is signed.

    {} without a secret. A node that cannot prove the secret gets nothing. The proof does not name the node that
    made it, so an impostor at a peer's address that can reach a real node may pass the challenge on to it and answer
    with that node's proof (and then relay or read what follows): only TLS, whose certificates name the peer, stops
    that (docs/operating.md, "What the secret does not guard").
    """
    if not secret:
        return {}
    asked = secrets.token_hex(16)
    async with client.get(http_base(base).rstrip("/") + CHALLENGE_PATH, params={"proof_for": asked},
                          ssl=ssl) as response:
        answer = await response.json(content_type=None)
    nonce = answer.get("nonce") if isinstance(answer, dict) else None
    proof = answer.get("proof") if isinstance(answer, dict) else None
    if response.status != 200 or not isinstance(nonce, str) or len(nonce) > 128:
        raise ConnectionError(f"{base} gave no challenge (HTTP {response.status})")
    if not isinstance(proof, str) or not proof.isascii() or \
            not hmac.compare_digest(proof, listener_proof(secret, asked, nonce)):
        raise ConnectionError(f"the node at {base} cannot prove it knows the mesh secret; not dialing it")
    audience = answer.get("node")
    audience = audience if is_key(audience) else ""
    if peer_key is not None and (not audience or not is_key(peer_key) or audience != peer_key):
        raise ConnectionError(f"the node at {base} holds another key than its head named; not dialing it")
    headers = {HEADER: sign(secret, nonce, method, path, body)}
    if identity is not None:
        headers[identity_header] = identity.header(nonce, method, path, body_digest(body), audience)
    return headers


def nonce_of(header: str | None) -> str | None:
    """The nonce a (well-formed) secret's header names."""
    match = _HEADER_FORM.match(header) if header and len(header) < 200 else None
    return "".join(match.group(2, 3, 4)) if match else None
