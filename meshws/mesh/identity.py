"""A node's own key: who it is, beyond knowing the mesh secret.

The mesh secret says "one of ours"; it cannot say which one, since every member holds it. So each node also has an
Ed25519 key pair, made at its first start and kept in its cache folder (`identity.key`, readable by its user
only; nodes started from one cache folder share it, as they share the machine and its user). A signed mesh request
(`auth.signed_headers`) carries, beside the secret's header, `X-Meshws-Node: <public key>.<signature>` over the
very nonce, method, path and body digest the secret's MAC covers and over the key of the node it is for (which
that node's challenge names, and which must be the one its head named where this node knows one): good for that
one request, on that one node, which cannot pass it on to another as this node's.

A head binds a joined node's advertised URL to the key its join proved, for as long as the registration lives:
another member cannot join, leave, dial in or open a relay in that URL's name while it does. An operator may pin
the keys a head accepts (`--trusted-nodes`, a file of fingerprints). `/health` shows a node's fingerprint: the
first 32 hex digits of the SHA-256 of its public key.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

HEADER = "X-Meshws-Node"
KEY_FILE = "identity.key"
_HEADER_FORM = re.compile(r"^([0-9a-f]{64})\.([0-9a-f]{128})$")
_FINGERPRINT = re.compile(r"^[0-9a-f]{32}$")
_P = 2**255 - 19


def is_key(value: object) -> bool:
    """A key in hex as nodes keep and name them: 64 lowercase hex digits."""
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def fingerprint(public_hex: str) -> str:
    return hashlib.sha256(bytes.fromhex(public_hex)).hexdigest()[:32]


def _message(nonce: str, method: str, path: str, body_digest: str, audience: str) -> bytes:
    return "\n".join(("meshws node", audience, nonce, method.upper(), path, body_digest)).encode()


class NodeIdentity:
    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self.public_hex = key.public_key().public_bytes_raw().hex()
        self.fingerprint = fingerprint(self.public_hex)

    @classmethod
    def generate(cls) -> "NodeIdentity":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, folder: Path) -> "NodeIdentity":
        """The key in `folder`/identity.key, made there first if there is none (two nodes starting at once from
        one folder end up with the one that was written first)."""
        path = folder / KEY_FILE
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            temporary = folder / f".{KEY_FILE}.{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()  # (one a crash left: never written through, as it could be a link)
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            os.fchmod(descriptor, 0o600)  # (whatever the umask)
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(Ed25519PrivateKey.generate().private_bytes_raw().hex().encode() + b"\n")
            with contextlib.suppress(FileExistsError):
                os.link(temporary, path)  # (never replaces a key another node wrote meanwhile)
            temporary.unlink()
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(descriptor, "rb") as handle:
            text = handle.read(256).decode(errors="replace").strip()
        if not is_key(text):
            raise ValueError(f"{path} does not hold a node key (64 hex digits); move it away to make a new one")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes.fromhex(text)))

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def header(self, nonce: str, method: str, path: str, body_digest: str, audience: str) -> str:
        """`X-Meshws-Node` for one request to the node whose key is `audience`, signed over what the secret's
        header covers."""
        signature = self._key.sign(_message(nonce, method, path, body_digest, audience))
        return f"{self.public_hex}.{signature.hex()}"


def verify(header: str | None, nonce: str, method: str, path: str, body_digest: str,
           audience: str) -> tuple[str | None, str]:
    """(the public key the header proves, ""), or (None, why not). `audience`: the verifying node's own key (a
    header made for another node's challenge, even with a nonce of this node's, does not hold here)."""
    if not header:
        return None, f"missing {HEADER} header (this node binds each member to its own key)"
    match = _HEADER_FORM.match(header) if len(header) < 256 else None
    if match is None:
        return None, f"malformed {HEADER} header"
    public_hex, signature = match.groups()
    if small_order(public_hex):
        return None, f"{HEADER} header's key is a weak point (of small order), not a node key"
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex)).verify(
            bytes.fromhex(signature), _message(nonce, method, path, body_digest, audience))
    except (InvalidSignature, ValueError):
        return None, f"{HEADER} header's signature does not hold for this request to this node"
    return public_hex, ""


def small_order(public_hex: str) -> bool:
    """Is this Ed25519 public key a point of small order (the identity and its kin, for which a signature can hold
    for any message), or not a canonical point at all? Its Montgomery form is tried in an X25519 exchange, which
    refuses exactly the small-order points."""
    encoded = int.from_bytes(bytes.fromhex(public_hex), "little")
    y = encoded & ((1 << 255) - 1)
    if y >= _P or y == 1:
        return True
    u = (1 + y) * pow(1 - y, -1, _P) % _P
    try:
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(u.to_bytes(32, "little")))
    except ValueError:
        return True
    return False


def read_fingerprints(path: str) -> frozenset[str]:
    """A file of fingerprints (`/health`'s `identity.fingerprint`), one a line; `#` starts a comment."""
    found = set()
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip().lower()
        if not text:
            continue
        if not _FINGERPRINT.match(text):
            raise ValueError(f"{path}:{number}: not a node fingerprint (32 hex digits): {text[:40]!r}")
        found.add(text)
    return frozenset(found)
