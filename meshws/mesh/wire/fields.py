"""Checks of single fields of a peer's JSON, shared by control and tensor frames."""

from __future__ import annotations

from typing import Any

MAX_SID_LENGTH = 128
MAX_NAME_LENGTH = 512
MAX_TEXT_LENGTH = 16 * 1024
MAX_CHAIN = 256  # hops in a chain or a route


class FrameError(ValueError):
    """A frame that cannot be accepted; the message says why, `sid` which session it was for."""

    def __init__(self, message: str, sid: str | None = None) -> None:
        super().__init__(message)
        self.sid = sid


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def sid_field(data: dict[str, Any]) -> str:
    sid = data.get("sid")
    if not isinstance(sid, str) or not sid or len(sid) > MAX_SID_LENGTH:
        raise FrameError(f"sid must be a non-empty string of at most {MAX_SID_LENGTH} characters")
    return sid


def int_field(data: dict[str, Any], name: str, minimum: int) -> int:
    value = data.get(name)
    if not is_int(value) or value < minimum:
        raise FrameError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def name_field(data: dict[str, Any], name: str) -> str:
    """A short non-empty string: a model id, a node name, a URL."""
    value = data.get(name)
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_LENGTH:
        raise FrameError(f"{name} must be a non-empty string of at most {MAX_NAME_LENGTH} characters")
    return value


def text_field(data: dict[str, Any], name: str) -> str | None:
    """An optional free text (a message, a reason)."""
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT_LENGTH:
        raise FrameError(f"{name} must be a string of at most {MAX_TEXT_LENGTH} characters")
    return value


def layers_field(data: dict[str, Any], name: str) -> tuple[int, int]:
    value = data.get(name)
    if not (isinstance(value, list) and len(value) == 2 and all(is_int(n) for n in value)
            and 0 <= value[0] < value[1]):
        raise FrameError(f"{name} must be [start, end] with 0 <= start < end, got {value!r}")
    return value[0], value[1]


def list_field(data: dict[str, Any], name: str) -> list[Any]:
    value = data.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_CHAIN:
        raise FrameError(f"{name} must be a list of at most {MAX_CHAIN} hops")
    return value


def ws_url_field(data: dict[str, Any], key: str) -> str:
    """A node's address a peer names (a route's hop, a standby): ws:// or wss:// only."""
    url = name_field(data, key)
    if not url.startswith(("ws://", "wss://")):
        raise FrameError(f"{key} must be a ws:// or wss:// url, got {url!r}")
    return url
