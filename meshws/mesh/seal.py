"""A relayed hop's frames, sealed between its two ends: the head that pipes them cannot alter them unseen.

Where neither a middle nor the tail after it can be dialed, their link runs through the head's relay (`relay`).
The head binds each node's URL to its key (`identity`), so no other member can stand in for either end; but the
head itself, or anyone on its path, could still change what it pipes. So both ends seal the socket first:

1. the middle sends `{"type": "seal", "node": <its key>, "eph": <X25519 public key, new for this socket>, "sig":
   <its signature of eph, its URL and the tail's>}`;
2. the tail checks that key is the one its head named for that middle (`expected`) and the signature, and answers
   the same with its own key and a fresh `eph`, its signature also covering the middle's `eph` (so an old answer
   cannot be replayed);
3. the middle checks the tail's key and signature the same way. Both derive two keys from the X25519 secret of the
   two `eph`s (HKDF-SHA256), one per direction.

Every later message goes as a binary frame: a MAC (HMAC-SHA256 of the direction's count of messages, the kind and
the payload, cut to MAC_BYTES) + the kind (0 text, 1 binary) + the payload. A frame whose MAC fails, or any frame
not sealed, closes the socket (code 1008): the link is lost as any dropped link is, and its sessions fail over.
What the head still can do: drop or delay frames (as any link's loss), and read them (they are not encrypted;
use TLS between nodes and the head for that). The keys a node expects come from its head: a head that lies about
them could stand in for both ends; `--trusted-nodes` on that head pins which keys it may name at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
from typing import Any

import aiohttp
import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .identity import NodeIdentity

MAC_BYTES = 16
SEAL_WAIT = 15.0  # seconds each side waits for the other's seal
_HEX = {"node": re.compile(r"^[0-9a-f]{64}$"), "eph": re.compile(r"^[0-9a-f]{64}$"),
        "sig": re.compile(r"^[0-9a-f]{128}$")}
_CLOSING = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED)


class SealBroken(Exception):
    """The other end could not prove the key expected of it, or a frame was not what it sent."""


def _statement(*parts: str) -> bytes:
    return "\n".join(("meshws seal", *parts)).encode()


async def seal_dialer(ws: Any, identity: NodeIdentity, own_url: str, peer_url: str, expected: str | None) -> "Sealed":
    """The middle's side (it dialed the relay): seal first, then check the tail's answer (the socket is closed if
    that fails)."""
    try:
        mine = X25519PrivateKey.generate()
        eph = mine.public_key().public_bytes_raw().hex()
        await ws.send_str(_seal(identity, eph, identity.sign(_statement("dial", eph, own_url, peer_url))))
        theirs = await _received_seal(ws, expected)
        _check(theirs, _statement("answer", theirs["eph"], eph, peer_url, own_url))
        return Sealed(ws, *_keys(mine, theirs["eph"], eph, theirs["eph"], dialer=True))
    except BaseException:
        await ws.close(code=1008, message=b"the relayed hop could not be sealed")
        raise


async def seal_answerer(ws: Any, identity: NodeIdentity, own_url: str, peer_url: str,
                        expected: str | None) -> "Sealed":
    """The tail's side (its relay-back socket): check the middle's seal, then answer with its own. It waits for the
    seal as long as the socket lives (it waits at the head for a middle to be paired with; heartbeats keep it)."""
    theirs = await _received_seal(ws, expected, None)
    _check(theirs, _statement("dial", theirs["eph"], peer_url, own_url))
    mine = X25519PrivateKey.generate()
    eph = mine.public_key().public_bytes_raw().hex()
    await ws.send_str(_seal(identity, eph, identity.sign(_statement("answer", eph, theirs["eph"], own_url,
                                                                     peer_url))))
    return Sealed(ws, *_keys(mine, theirs["eph"], theirs["eph"], eph, dialer=False))


def _seal(identity: NodeIdentity, eph: str, signature: bytes) -> str:
    return orjson.dumps({"type": "seal", "node": identity.public_hex, "eph": eph, "sig": signature.hex()}).decode()


async def _received_seal(ws: Any, expected: str | None, wait: float | None = SEAL_WAIT) -> dict[str, str]:
    if not expected:
        raise SealBroken("no key is known for the other end of this relayed hop (its head has not named one)")
    try:
        message = await ws.receive(timeout=wait)
    except asyncio.TimeoutError:
        raise SealBroken(f"no seal from the other end within {SEAL_WAIT:g} s") from None
    try:
        seal = orjson.loads(message.data) if message.type == aiohttp.WSMsgType.TEXT and len(message.data) < 1024 \
            else None
    except orjson.JSONDecodeError:
        seal = None
    if not isinstance(seal, dict) or seal.get("type") != "seal" \
            or not all(isinstance(seal.get(name), str) and form.match(seal[name]) for name, form in _HEX.items()):
        raise SealBroken("the other end's first frame is not a seal")
    if not expected.isascii() or not hmac.compare_digest(seal["node"], expected):
        raise SealBroken("the other end holds another key than its head named")
    return seal


def _check(seal: dict[str, str], statement: bytes) -> None:
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(seal["node"])).verify(bytes.fromhex(seal["sig"]), statement)
    except (InvalidSignature, ValueError):
        raise SealBroken("the other end's seal is not signed by its key for this hop") from None


def _keys(mine: X25519PrivateKey, theirs: str, dial_eph: str, answer_eph: str, dialer: bool) -> tuple[bytes, bytes]:
    """(this side's sending key, its receiving key)."""
    try:
        shared = mine.exchange(X25519PublicKey.from_public_bytes(bytes.fromhex(theirs)))
    except ValueError:
        raise SealBroken("the other end's seal holds no usable key") from None
    both = HKDF(hashes.SHA256(), 64, salt=None, info=_statement("keys", dial_eph, answer_eph)).derive(shared)
    to_answerer, to_dialer = both[:32], both[32:]
    return (to_answerer, to_dialer) if dialer else (to_dialer, to_answerer)


class Sealed:
    """A websocket whose every message after the seal carries its MAC: what links and shard services use of
    aiohttp's sockets (send_str, send_bytes, receive, iteration, close, closed, close_code, exception)."""

    def __init__(self, ws: Any, send_key: bytes, receive_key: bytes) -> None:
        self.ws = ws
        self._send_key, self._receive_key = send_key, receive_key
        self._sent = self._received = 0
        self._lock = asyncio.Lock()  # (a message's count is its place on the wire)
        self.broken: str | None = None  # why the socket was closed, if a frame failed its MAC

    def _mac(self, key: bytes, count: int, kind: bytes, payload: bytes) -> bytes:
        digest = hmac.new(key, count.to_bytes(8, "big") + kind, hashlib.sha256)
        digest.update(payload)
        return digest.digest()[:MAC_BYTES]

    async def _send(self, kind: bytes, payload: bytes) -> None:
        async with self._lock:
            mac = self._mac(self._send_key, self._sent, kind, payload)
            self._sent += 1
            await self.ws.send_bytes(b"".join((mac, kind, payload)))

    async def send_str(self, data: str) -> None:
        await self._send(b"\x00", data.encode())

    async def send_bytes(self, data: bytes) -> None:
        await self._send(b"\x01", bytes(data))

    async def receive(self, timeout: float | None = None) -> aiohttp.WSMessage:
        message = await self.ws.receive(timeout=timeout)
        if message.type in _CLOSING or message.type == aiohttp.WSMsgType.ERROR:
            return message
        data = message.data if message.type == aiohttp.WSMsgType.BINARY else b""
        kind, payload = data[MAC_BYTES:MAC_BYTES + 1], data[MAC_BYTES + 1:]
        if kind not in (b"\x00", b"\x01") or not hmac.compare_digest(
                data[:MAC_BYTES], self._mac(self._receive_key, self._received, kind, payload)):
            self.broken = "a relayed frame failed its MAC (altered, replayed or out of order): link closed"
            await self.ws.close(code=1008, message=b"sealed frame failed its MAC")
            return aiohttp.WSMessage(aiohttp.WSMsgType.ERROR, SealBroken(self.broken), None)
        self._received += 1
        if kind == b"\x00":
            return aiohttp.WSMessage(aiohttp.WSMsgType.TEXT, payload.decode(errors="replace"), None)
        return aiohttp.WSMessage(aiohttp.WSMsgType.BINARY, payload, None)

    def __aiter__(self) -> "Sealed":
        return self

    async def __anext__(self) -> aiohttp.WSMessage:
        message = await self.receive()
        if message.type in _CLOSING:
            raise StopAsyncIteration
        return message

    async def close(self, *, code: int = 1000, message: bytes = b"") -> bool:
        return await self.ws.close(code=code, message=message)

    @property
    def closed(self) -> bool:
        return self.ws.closed

    @property
    def close_code(self) -> int | None:
        return self.ws.close_code

    def exception(self) -> BaseException | None:
        return SealBroken(self.broken) if self.broken else self.ws.exception()
