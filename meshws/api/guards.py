"""Who may reach a node from a browser: Host and Origin checks, JSON-only bodies, CORS, security headers.

Loopback is not a boundary: any page the user visits can send requests to
`127.0.0.1`. So:
  * `/mesh/*` and `/ws/shard` refuse any request with an `Origin` header (nodes never
    send one) and POSTs that are not JSON;
  * the page, `/ws/chat` and `/v1/*` answer only a `Host` that is an IP address, a
    loopback name, one of this node's own names or one given with `--allowed-hosts`
    (a DNS-rebinding page arrives with its own domain as Host), and only browser
    origins that are the node's own or listed in `--cors-origins`;
  * API POSTs must be JSON (a cross-site form or `text/plain` fetch is refused before
    anything is read), and allowed cross-origin callers get proper CORS answers.
Every answer carries a Content-Security-Policy without inline script,
`X-Content-Type-Options: nosniff` and `frame-ancestors 'none'`.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from aiohttp import web

from .errors import ApiError, is_api_path, json_response

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type"
CORS_KEY = web.RequestKey("meshws_cors", dict)  # the request's CORS answer headers, while it is served


def _is_mesh_path(path: str) -> bool:
    return path.startswith("/mesh/") or path == "/ws/shard"


def _is_browser_path(path: str) -> bool:
    # /health and /metrics are not here: load balancers probe them under names of their own, and a
    # foreign Host only ever gets the public view of /health (`access.direct_loopback`).
    return path == "/" or path.startswith("/static/") or is_api_path(path) or path == "/ws/chat"


def host_name(host: str) -> str:
    """'Example.org:8700' -> 'example.org'; '[::1]:8700' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestGuard:
    def __init__(self, own_hosts: Iterable[str], allowed_hosts: Iterable[str] = (),
                 cors_origins: Iterable[str] = (), mesh_hosts_checked: bool = False) -> None:
        self.mesh_hosts_checked = mesh_hosts_checked  # no secret: /mesh/* trusts loopback, so rebinding matters
        self.hosts = {host_name(h) for h in (*own_hosts, *allowed_hosts) if h}
        self.cors_origins = {origin.rstrip("/").lower() for origin in cors_origins}

    def host_allowed(self, host: str | None) -> bool:
        """IP literals (no DNS to rebind), loopback names, and the names this node was given."""
        if not host:
            return False
        name = host_name(host)
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return name == "localhost" or name.endswith(".localhost") or name in self.hosts

    def origin_allowed(self, origin: str | None, host: str | None) -> bool:
        """No Origin (not a browser), the node's own origin, or one of --cors-origins."""
        if origin is None:
            return True
        origin = origin.rstrip("/").lower()
        return origin in self.cors_origins or (bool(host) and urlsplit(origin).netloc == (host or "").lower())

    def middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        @web.middleware
        async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
            refusal = self._refusal(request)
            if refusal is not None:
                return refusal
            origin = request.headers.get("Origin")
            cors = origin is not None and origin.rstrip("/").lower() in self.cors_origins \
                and is_api_path(request.path)
            if cors and request.method == "OPTIONS":
                return web.Response(status=204, headers=self._cors_headers(origin, preflight=True))
            if cors:  # added as the response is prepared (`add_security_headers`): streams too
                request[CORS_KEY] = self._cors_headers(origin)
            return await handler(request)

        return guard

    def _refusal(self, request: web.Request) -> web.StreamResponse | None:
        path, headers = request.path, request.headers
        if _is_mesh_path(path):
            if "Origin" in headers:
                return json_response({"error": "cross-site requests to mesh endpoints are refused"}, status=403)
            if self.mesh_hosts_checked and not self.host_allowed(request.host):
                return json_response({"error": "the Host header is not one of this node's names"}, status=400)
            if request.method == "POST" and request.content_type != "application/json":
                return json_response({"error": "send the body as application/json"}, status=415)
            return None
        if not _is_browser_path(path):
            return None
        if not self.host_allowed(request.host):
            return ApiError(400, f"the Host header {request.host[:100]!r} is not one of this node's names; "
                                 "start the node with --allowed-hosts to add it", code="host_not_allowed").response()
        if not self.origin_allowed(headers.get("Origin"), request.host):
            return ApiError(403, "this origin may not call the API; start the node with --cors-origins to allow it",
                            code="origin_not_allowed").response()
        if request.method == "POST" and is_api_path(path) and request.content_type != "application/json":
            return ApiError(415, "send the body as application/json", code="unsupported_media_type").response()
        return None

    @staticmethod
    def _cors_headers(origin: str, preflight: bool = False) -> dict[str, str]:
        headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if not preflight:
            headers["Access-Control-Expose-Headers"] = "Retry-After"
        if preflight:
            headers.update({"Access-Control-Allow-Methods": CORS_METHODS,
                            "Access-Control-Allow-Headers": CORS_HEADERS, "Access-Control-Max-Age": "600"})
        return headers


async def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """An `on_response_prepare` signal: every answer carries the security headers."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    response.headers.update(request.get(CORS_KEY, {}))
