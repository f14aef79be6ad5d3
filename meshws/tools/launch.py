"""Start real node processes through the CLI on loopback (used by tests, the benchmark and `./dev mesh`)."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

READY = re.compile(r"meshws (\w+) ready: .* on https?://[^ ]+:(\d+)")


class NodeProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None, name: str = "node", port: int = 0,
                 echo: bool = False, ca: str | None = None, host: str = "127.0.0.1", netns: str | None = None,
                 cpus: str | None = None) -> None:
        self.host = host  # where it listens (and where url, ws_url and health reach it)
        self.args = ["--host", host, "--port", str(port), *args]
        self.name = name
        self.tls = "--tls-cert" in args  # the node serves https:// and wss://
        self.ssl_context = ssl.create_default_context(cafile=ca) if ca else None  # to verify it
        self.echo = echo  # print the node's output as it comes, prefixed with its name
        self.lines: list[str] = []
        self.port: int | None = None
        self._ready = threading.Event()
        full_env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
        inside = ["ip", "netns", "exec", netns] if netns else []  # another host: a network namespace
        inside += ["taskset", "-c", cpus] if cpus else []  # only these cores (the node then counts them alone)
        self.proc = subprocess.Popen(
            [*inside, sys.executable, "-m", "meshws.node", *self.args],
            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if self.echo:
                print(f"[{self.name}] {line}", end="", flush=True)
            match = READY.search(line)
            if match and self.port is None:
                self.port = int(match.group(2))
                self._ready.set()
        self._ready.set()

    def wait_started(self, timeout: float = 120.0) -> "NodeProcess":
        if not self._ready.wait(timeout) or self.port is None:
            self.stop()
            raise AssertionError(f"{self.name} did not start:\n" + "\n".join(self.lines[-30:]))
        return self

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.tls else 'ws'}://{self.host}:{self.port}"

    def health(self) -> dict:
        """The node's /health, whether it answers 200 (ready) or 503 (not yet, or draining)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5, context=self.ssl_context) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                raise
            with exc:
                return json.loads(exc.read())

    def wait_ready(self, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if health["ready"]:
                return health
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} not ready: {health['problems']}")
            time.sleep(0.1)

    def wait_sessions(self, count: int, timeout: float = 8.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if health["sessions"] == count:
                return health
            if time.monotonic() > deadline:
                return health
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)
        return self.proc.returncode


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Mesh:
    """A chain of node processes, head (or full) first, tail last, started side by side."""

    def __init__(self, specs: list[tuple[str, str]], common: tuple[str, ...] = (),
                 extra: dict[str, tuple[str, ...]] | None = None, ports: list[int] | None = None,
                 echo: bool = False, timeout: float = 120.0, ca: str | None = None,
                 split_threads: bool = True, cpus: list[str] | None = None) -> None:
        self.nodes: list[NodeProcess] = []
        ports = ports or [free_port() for _ in specs]
        if split_threads and "--threads" not in common:
            # Nodes on one machine share its cores: oversubscribed OpenMP threads spin against each other.
            # (Nodes without --threads split them too (`cores`), re-counting as nodes come; this is at once.)
            common = (*common, "--threads", str(max(1, (os.cpu_count() or 1) // len(specs))))
        try:
            for index, (role, layers) in enumerate(specs):
                args = ["--role", role, "--layers", layers, *common, *(extra or {}).get(role, ())]
                if index + 1 < len(specs):
                    scheme = "wss" if "--tls-cert" in args else "ws"
                    args += ["--peer", f"{scheme}://127.0.0.1:{ports[index + 1]}"]
                self.nodes.append(NodeProcess(*args, name=f"{role} {layers}", port=ports[index], echo=echo,
                                              ca=ca, cpus=cpus[index] if cpus else None))
            for node in self.nodes:
                node.wait_started(timeout)
            self.head.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def head(self) -> NodeProcess:
        return self.nodes[0]

    @property
    def tail(self) -> NodeProcess:
        return self.nodes[-1]

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def running(self) -> bool:
        return all(node.proc.poll() is None for node in self.nodes)
