"""What an address names: the one place that decides whether a host or URL is this machine's loopback.

Parsed, never matched by prefix: `127.evil.example` (a DNS name an attacker can point at
127.0.0.1) and `ws://127.0.0.1@evil.example` are not loopback.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def is_loopback(host: str) -> bool:
    """`127.0.0.1`, `::1`, `[::1]`, `localhost`: yes; any other name or address: no."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(url: str) -> str:
    """ws://host:port -> host ('' when the URL names none)."""
    try:
        return urlsplit(url).hostname or ""
    except ValueError:
        return ""


def is_loopback_url(url: str) -> bool:
    """ws://127.0.0.1:8701 yes; ws://127.0.0.1@evil.example or ws://127.evil.example no."""
    try:
        parts = urlsplit(url)
        if parts.username is not None or parts.password is not None:
            return False
        return is_loopback(parts.hostname or "")
    except ValueError:
        return False
