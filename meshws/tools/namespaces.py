"""Other hosts on this machine, for tests and benchmarks: network namespaces joined to this one by veth pairs
(root only; `iptables` inside one makes it a host behind NAT)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from typing import Iterator

DROP_INBOUND = ["iptables", "-A", "INPUT", "-i", "{device}", "-p", "tcp", "--syn", "-j", "DROP"]  # behind NAT


@contextlib.contextmanager
def other_host(host_ip: str, peer_ip: str, *inside: list[str]) -> Iterator[str]:
    """Another host on this machine: a network namespace joined to this one by a veth pair (`host_ip` this side,
    `peer_ip` that side); `inside`: more commands run in it (each a list, after `ip netns exec NAME`). Yields its
    name and the name of its end of the pair; removes both."""
    name = f"mws{uuid.uuid4().hex[:6]}"
    commands = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", f"{name}h", "type", "veth", "peer", "name", f"{name}p"],
        ["ip", "link", "set", f"{name}p", "netns", name],
        ["ip", "addr", "add", f"{host_ip}/30", "dev", f"{name}h"],
        ["ip", "link", "set", f"{name}h", "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{peer_ip}/30", "dev", f"{name}p"],
        ["ip", "netns", "exec", name, "ip", "link", "set", f"{name}p", "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
        *(["ip", "netns", "exec", name, *[part.replace("{device}", f"{name}p") for part in command]]
          for command in inside),
    ]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True, text=True)
        yield name
    finally:
        subprocess.run(["ip", "link", "del", f"{name}h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
