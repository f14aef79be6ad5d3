"""Control frames: one JSON object per websocket text frame, one frozen dataclass per type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Union

import orjson

from ...model.backend import TokenLogprob
from ...model.text.sampling_params import DEFAULT as DEFAULT_SAMPLING
from ...model.text.sampling_params import MAX_PROMPT_LOGPROBS, MAX_TOP_LOGPROBS, SamplingParams
from .fields import (
    MAX_TEXT_LENGTH,
    FrameError,
    int_field,
    is_int,
    layers_field,
    list_field,
    name_field,
    sid_field,
    text_field,
    ws_url_field,
)
from .hops import HopReport
from .kv import KVAck

PROTOCOL_VERSION = 5  # 5: `open` names the receiver's layers; 4: a wave's decode steps may share a frame (`rows`)
MAX_CONTROL_BYTES = 1024 * 1024  # (a prefill's answer may carry 4096 prompt tokens' log-probabilities)
MAX_TOKEN_IDS = 17  # tokens one step may yield: its drafts (at most 16) and one more


@dataclass(frozen=True)
class ChainHop:
    """One node of a chain, as people and `hello` see it."""

    node: str
    layers: tuple[int, int]

    def to_wire(self) -> dict[str, Any]:
        return {"node": self.node, "layers": list(self.layers)}

    @classmethod
    def parse(cls, data: Any) -> "ChainHop":
        if not isinstance(data, dict):
            raise FrameError("each hop of a chain must be an object")
        return cls(name_field(data, "node"), layers_field(data, "layers"))


@dataclass(frozen=True)
class RouteHop:
    """A hop a session goes through next, as `open` names it."""

    url: str
    layers: tuple[int, int] | None = None
    standby: str | None = None  # where that hop sends the session's keys and values (`mesh.standby`)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"url": self.url}
        if self.layers is not None:
            wire["layers"] = list(self.layers)
        if self.standby is not None:
            wire["standby"] = self.standby
        return wire

    @classmethod
    def parse(cls, data: Any) -> "RouteHop":
        if not isinstance(data, dict):
            raise FrameError("each hop of a route must be an object with a url")
        return cls(ws_url_field(data, "url"), layers_field(data, "layers") if data.get("layers") is not None else None,
                   ws_url_field(data, "standby") if data.get("standby") is not None else None)


@dataclass(frozen=True)
class Hello:
    """First frame both ways on a link: who the node is and the static chain behind it."""

    type: ClassVar[str] = "hello"
    model: str
    layers: tuple[int, int]
    role: str
    node: str
    total_layers: int
    chain: tuple[ChainHop, ...] = ()  # this node and the static chain behind it
    version: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "version": self.version, "model": self.model, "layers": list(self.layers),
                "role": self.role, "node": self.node, "total_layers": self.total_layers,
                "chain": [hop.to_wire() for hop in self.chain]}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "Hello":
        version = int_field(data, "version", 0)
        if version != PROTOCOL_VERSION:  # first: other fields may mean other things in another version
            raise FrameError(f"peer speaks protocol {version}, this node {PROTOCOL_VERSION}")
        layers = layers_field(data, "layers")
        total = int_field(data, "total_layers", 1)
        if layers[1] > total:
            raise FrameError(f"hello layers {list(layers)} end beyond total_layers {total}")
        chain = tuple(ChainHop.parse(hop) for hop in list_field(data, "chain"))
        return cls(name_field(data, "model"), layers, name_field(data, "role"), name_field(data, "node"), total,
                   chain)


@dataclass(frozen=True)
class Open:
    """A new session channel (or a re-open after a failure): its sampling and its route.

    `resume`: a conversation's next turn. A shard that carries the session on this link,
    to the same next hop, keeps its cache and takes the new sampling; any other shard
    opens it afresh (its first step then answers `cache_miss` and the head re-prefills).
    `fork`: one of several choices of a request (`n`): the new session's cache starts as a
    copy of the first `length` positions of another session on the same link, so the
    prompt is prefilled once; a shard that lacks that session starts empty (a cache miss).
    `kept`: the session holds a prompt prefix the head keeps for other sessions to fork (`head.prefixes`): a
    shard counts it apart from its users' sessions.
    `layers`: the span the head's route expects the receiver to run; a node that serves another span now
    (its layers moved: `head.placement`) refuses the session as lost, so no hidden state meets the wrong layers.
    """

    type: ClassVar[str] = "open"
    sid: str
    sampling: SamplingParams = DEFAULT_SAMPLING
    prompt_tokens: int | None = None  # where generated tokens start (for the OpenAI-style penalties)
    route: tuple[RouteHop, ...] = ()  # hops after the receiver; empty: the receiver's --peer
    route_mac: str | None = None  # the route signed with the mesh secret (a middle dials only signed hops)
    resume: bool = False  # keep the session's cache if this link carries it already
    fork: tuple[str, int] | None = None  # (sid, length): start the cache as a copy of that session's first positions
    layers: tuple[int, int] | None = None  # the receiver's span as the route expects it (None: not checked)
    kept: bool = False  # a shared prompt prefix, not a user's session
    standby: str | None = None  # a node of the receiver's layers to send the session's keys and values to
    hold: bool = False  # the hop before has a standby: if its link drops, keep the session a while for a head

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": self.type, "sid": self.sid, "sampling": self.sampling.to_wire()}
        for flag in ("kept", "hold"):
            if getattr(self, flag):
                message[flag] = True
        if self.fork is not None:
            message["fork"] = {"sid": self.fork[0], "length": self.fork[1]}
        if self.prompt_tokens is not None:
            message["prompt_tokens"] = self.prompt_tokens
        if self.route:
            message["route"] = [hop.to_wire() for hop in self.route]
        if self.route_mac is not None:
            message["route_mac"] = self.route_mac
        if self.resume:
            message["resume"] = True
        if self.layers is not None:
            message["layers"] = list(self.layers)
        if self.standby is not None:
            message["standby"] = self.standby
        return message

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "Open":
        sid = sid_field(data)
        try:
            sampling = SamplingParams.from_wire(data.get("sampling"))
            prompt_tokens = int_field(data, "prompt_tokens", 0) if data.get("prompt_tokens") is not None else None
            route = tuple(RouteHop.parse(hop) for hop in list_field(data, "route"))
            route_mac = name_field(data, "route_mac") if data.get("route_mac") is not None else None
            resume, kept, hold = (data.get(name, False) for name in ("resume", "kept", "hold"))
            if not all(isinstance(flag, bool) for flag in (resume, kept, hold)):
                raise FrameError("resume, kept and hold must be true or false")
            fork = data.get("fork")
            if fork is not None:
                if not isinstance(fork, dict):
                    raise FrameError("fork must be {sid, length}")
                fork = (sid_field(fork), int_field(fork, "length", 1))
            layers = layers_field(data, "layers") if data.get("layers") is not None else None
            standby = ws_url_field(data, "standby") if data.get("standby") is not None else None
        except ValueError as exc:  # FrameError included
            raise FrameError(f"bad open: {exc}", sid) from None
        return cls(sid=sid, sampling=sampling, prompt_tokens=prompt_tokens, route=route, route_mac=route_mac,
                   resume=resume, fork=fork, layers=layers, kept=kept, standby=standby, hold=hold)


@dataclass(frozen=True)
class Token:
    """The tail's answer to a step: the sampled token id (a legacy tail sends only text).

    After a step with drafts, `token_ids` lists every token it yields in order (the drafts
    the tail agreed with, then its own choice, which is also `token_id`). `hops` reports
    each shard's part of the step in route order: the tail starts it, and every shard the
    answer passes on the way back puts its own report in front.
    """

    type: ClassVar[str] = "token"
    sid: str
    step: int
    token_id: int | None
    text: str | None = None
    token_ids: tuple[int, ...] = ()
    hops: tuple[HopReport, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": self.type, "sid": self.sid, "step": self.step, "token_id": self.token_id}
        if self.text is not None:
            message["text"] = self.text
        if self.token_ids:
            message["token_ids"] = list(self.token_ids)
        if self.hops:
            message["hops"] = [hop.to_wire() for hop in self.hops]
        for name in ("logprobs", "prompt_logprobs"):
            entries = getattr(self, name)
            if entries:
                message[name] = [[_finite(lp), [[token, _finite(alt)] for token, alt in top]] for lp, top in entries]
        return message

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "Token":
        sid = sid_field(data)
        try:
            token_id = int_field(data, "token_id", 0) if data.get("token_id") is not None else None
            text = text_field(data, "text")
            if token_id is None and text is None:
                raise FrameError("a token frame needs a token_id or a text")
            raw = data.get("token_ids") or []
            if not isinstance(raw, list) or len(raw) > MAX_TOKEN_IDS or not all(is_int(t) and t >= 0 for t in raw) \
                    or (raw and raw[-1] != token_id):
                raise FrameError(f"token_ids must be at most {MAX_TOKEN_IDS} token ids ending with token_id")
            hops = tuple(HopReport.parse(hop) for hop in list_field(data, "hops"))
            logprobs = _logprobs_field(data.get("logprobs"), max(1, len(raw)))
            prompt = data.get("prompt_logprobs")
            if prompt is not None and (not isinstance(prompt, list) or len(prompt) > MAX_PROMPT_LOGPROBS):
                raise FrameError(f"prompt_logprobs must be a list of at most {MAX_PROMPT_LOGPROBS} entries")
            prompt_logprobs = _logprobs_field(prompt, len(prompt or ()))
            return cls(sid, int_field(data, "step", 0), token_id, text, tuple(raw), hops, logprobs, prompt_logprobs)
        except FrameError as exc:
            raise FrameError(str(exc), sid) from None


MIN_LOGPROB = -1e4  # what a log-probability of -inf (or below) travels as: JSON has no infinity


def _finite(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # (NaN too)


def _is_logprob(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and MIN_LOGPROB <= value <= 0.001


def _logprobs_field(raw: Any, tokens: int) -> tuple[TokenLogprob, ...]:
    """`[[logprob, [[id, logprob], ...]], ...]`: one entry per token the frame yields, if any."""
    if raw is None:
        return ()
    problem = FrameError(f"logprobs must be {tokens} entries [logprob, [[id, logprob], ...at most "
                         f"{MAX_TOP_LOGPROBS}]]")
    if not isinstance(raw, list) or len(raw) != tokens:
        raise problem
    entries = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 2 and _is_logprob(entry[0]) and isinstance(entry[1], list)
                and len(entry[1]) <= MAX_TOP_LOGPROBS):
            raise problem
        top = entry[1]
        if not all(isinstance(alt, list) and len(alt) == 2 and is_int(alt[0]) and alt[0] >= 0 and _is_logprob(alt[1])
                   for alt in top):
            raise problem
        entries.append((float(min(entry[0], 0.0)), tuple((alt[0], float(min(alt[1], 0.0))) for alt in top)))
    return tuple(entries)


@dataclass(frozen=True)
class CacheMiss:
    """A shard lacks the session's cache (or holds another length): the head re-prefills."""

    type: ClassVar[str] = "cache_miss"
    sid: str
    step: int
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "sid": self.sid, "step": self.step, "reason": self.reason}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "CacheMiss":
        return cls(sid_field(data), int_field(data, "step", 0), text_field(data, "reason") or "cache miss")


@dataclass(frozen=True)
class Error:
    """Something went wrong: a bad frame (no sid), or a session's step or route failed."""

    type: ClassVar[str] = "error"
    message: str
    sid: str | None = None
    step: int | None = None
    lost: bool = False  # a hop went away or hung: another route may work
    url: str | None = None  # the hop that went away, when known

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": self.type, "message": self.message[:MAX_TEXT_LENGTH]}
        for name in ("sid", "step", "url"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        if self.lost:
            message["lost"] = True
        return message

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "Error":
        sid = sid_field(data) if data.get("sid") is not None else None
        step = int_field(data, "step", 0) if data.get("step") is not None else None
        lost = data.get("lost", False)
        if not isinstance(lost, bool):
            raise FrameError("an error's lost must be a boolean", sid)
        message = text_field(data, "message")
        if message is None:
            raise FrameError("an error frame needs a message", sid)
        return cls(message, sid, step, lost, name_field(data, "url") if data.get("url") is not None else None)


@dataclass(frozen=True)
class Close:
    """The session is over: drop its cache here and pass the close on. `grace`: its standby's copy waits a while
    for a head (the session was replaced here, and may be resuming there)."""

    type: ClassVar[str] = "close"
    sid: str
    grace: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.type, "sid": self.sid, **({"grace": True} if self.grace else {})}

    @classmethod
    def parse(cls, data: dict[str, Any]) -> "Close":
        return cls(sid_field(data), data.get("grace") is True)


ControlMessage = Union[Hello, Open, Token, CacheMiss, Error, Close, KVAck]
SessionReply = Union[Token, CacheMiss, Error, KVAck]  # what a session's subscriber receives
_TYPES: dict[str, Any] = {kind.type: kind for kind in (Hello, Open, Token, CacheMiss, Error, Close, KVAck)}


def encode_control(message: ControlMessage) -> str:
    return orjson.dumps(message.to_wire()).decode()


def decode_control(text: str | bytes) -> ControlMessage:
    """Parse a text frame into its message; FrameError names what is wrong."""
    if len(text) > MAX_CONTROL_BYTES:
        raise FrameError(f"control frame of {len(text)} bytes is too large")
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"control frame is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FrameError("control frame must be a JSON object")
    kind = _TYPES.get(data["type"]) if isinstance(data.get("type"), str) else None
    if kind is None:
        raise FrameError(f"unknown frame type {data.get('type')!r}")
    return kind.parse(data)
