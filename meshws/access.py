"""Who may do what on a node: the mesh secret's checks, loopback-only without one, the detailed view, TLS.

* `/mesh/*` and `/ws/shard` need a valid mesh-secret header (`mesh.auth`); a node
  without a secret answers them from loopback only, unless it runs `--insecure`.
* With a secret, a node has a key of its own (`mesh.identity`), made in its cache
  folder; requests that act in a member's name (joins, leaves, dial-ins, relays)
  prove it (`identify`), and a head may accept only the keys it was given.
* The detailed `/health` (links, nodes, URLs, loads, errors) and node names in
  `/ws/chat` routes are for loopback clients, holders of the API key and of the
  mesh secret; everyone else sees status, readiness, role, model and layers.
* TLS: the context a node serves HTTPS/WSS with, and the one it verifies peers with
  (verification always on: the system's CAs, or `--tls-ca`).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from aiohttp import web

from .config import NodeSettings
from .api.errors import key_matches
from .api.guards import host_name
from .mesh.addresses import is_loopback
from .mesh import identity as node_identity
from .mesh.auth import HEADER, Verifier, body_digest, listener_proof, nonce_of
from .model.gguf.model_files import default_cache_dir


class NodeAccess:
    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.verifier = Verifier(settings.secret)
        self.identity: node_identity.NodeIdentity | None = None  # this node's key (with a secret)
        if settings.secret:
            folder = Path(settings.cache_dir).expanduser() if settings.cache_dir else default_cache_dir()
            try:
                self.identity = node_identity.NodeIdentity.load_or_create(folder)
            except (OSError, ValueError) as exc:
                raise SystemExit(f"meshws: this node's key cannot be used: {exc}") from None
        self.trusted = node_identity.read_fingerprints(settings.trusted_nodes) if settings.trusted_nodes else None

    def identify(self, request: web.Request, body: bytes) -> tuple[str, str | None]:
        """(the member's key, None), or ("", why not): after `authorize` passed. Without a secret nobody has a key
        to prove: ("", None)."""
        if not self.settings.secret:
            return "", None
        assert self.identity is not None
        key, problem = node_identity.verify(request.headers.get(node_identity.HEADER), nonce_of(request.headers.get(
            HEADER)) or "", request.method, request.path, body_digest(body), self.identity.public_hex)
        if key is None:
            return "", problem
        if self.trusted is not None and node_identity.fingerprint(key) not in self.trusted:
            return "", f"node key {node_identity.fingerprint(key)} is not among this head's --trusted-nodes"
        return key, None

    def authorize(self, request: web.Request, body: bytes) -> str | None:
        """May this request use /mesh or /ws/shard? None, or why not."""
        if self.settings.secret:
            return self.verifier.check(request.headers.get(HEADER), request.method, request.path, body)
        if self.settings.insecure or direct_loopback(request):
            return None
        return "this node has no mesh secret: it answers mesh requests from loopback clients only (not via proxies)"

    def precheck(self, request: web.Request) -> str | None:
        """`authorize` as far as it can go before the body is read."""
        if self.settings.secret:
            return self.verifier.precheck(request.headers.get(HEADER))
        return self.authorize(request, b"")

    def detail_allowed(self, request: web.Request) -> bool:
        """May this client see the mesh's insides (URLs, links, loads, errors)?"""
        if direct_loopback(request):
            return True
        key = self.settings.api_key
        given = request.headers.get("Authorization", "")
        if key and given.startswith("Bearer ") and key_matches(given[7:], key):
            return True
        return bool(self.settings.secret) and HEADER in request.headers and self.authorize(request, b"") is None

    async def challenge(self, request: web.Request) -> web.Response:
        """GET /mesh/challenge?proof_for=X: a nonce for one signed request to this node, and its proof of the secret."""
        nonce = self.verifier.challenge()
        answer = {"nonce": nonce}
        asked = request.query.get("proof_for", "")
        if self.settings.secret and 0 < len(asked) <= 64 and asked.isalnum():
            answer["proof"] = listener_proof(self.settings.secret, asked, nonce)
        if self.identity is not None:  # (a member's signature names the key it is for: this one)
            answer["node"] = self.identity.public_hex
        return web.json_response(answer)


PROXY_HEADERS = ("Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Real-IP")


def direct_loopback(request: web.Request) -> bool:
    """A client on this machine talking to the node itself: not through a proxy, not a rebound domain."""
    if not is_loopback(request.remote or "") or any(name in request.headers for name in PROXY_HEADERS):
        return False
    return is_loopback(host_name(request.host or ""))


def tls_contexts(settings: NodeSettings) -> tuple[ssl.SSLContext | None, ssl.SSLContext]:
    """The context this node serves HTTPS/WSS with (None: plain), and the one it verifies peers with."""
    server = None
    if settings.tls_cert:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server.load_cert_chain(settings.tls_cert, settings.tls_key)
    client = ssl.create_default_context(cafile=settings.tls_ca)  # verification on, always
    return server, client

