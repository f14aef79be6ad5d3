"""`python -m meshws.tools.nat_bench`: what a tail behind NAT costs per token (root only: network namespaces).

A head and a middle on this host; a tail in another namespace, started in turn behind NAT (inbound SYNs
dropped, so its links are dialed the other way: `mesh.reverse`) and reachable (dialed as usual). Each round
streams one answer of `--tokens` tokens three times with each tail; the medians' ratio is the per-token time
behind NAT over reachable (issue 45's target: <= 1.15).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from .launch import NodeProcess, free_port
from .namespaces import DROP_INBOUND, other_host
from .streams import stream_once

SECRET = "nat-bench-secret-0123456789abcdef"


def _answer(url: str, model: str, prompt: list[int], tokens: int, wait: float = 30.0) -> float:
    """One stream's decode tok/s (retried while the head plans its first route through a new tail)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return asyncio.run(stream_once(url, model, prompt, tokens + 1))["decode_tok_s"]
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshws.tools.nat_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model-id", default="SmolLM2-135M-Instruct", help="the served model's id")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="meshws-nat-")
    secret = os.path.join(folder, "mesh.secret")
    with open(secret, "w") as file:
        file.write(SECRET + "\n")
    os.chmod(secret, 0o600)
    flags = ("--secret-file", secret)
    prompt = [1000 + 7 * index for index in range(16)]
    rates: dict[str, list[float]] = {"behind NAT": [], "reachable": []}
    with other_host("10.231.20.1", "10.231.20.2", DROP_INBOUND) as nat, \
            other_host("10.231.21.1", "10.231.21.2") as plain:
        head_port, middle_port = free_port(), free_port()
        head = NodeProcess("--role", "head", "--layers", "0-9", "--host", "0.0.0.0", *flags, port=head_port)
        middle = None
        try:
            head.wait_started()
            middle = NodeProcess("--role", "middle", "--layers", "10-19", "--host", "0.0.0.0", "--advertise",
                                 f"ws://10.231.20.1:{middle_port}", *flags, "--join", f"http://127.0.0.1:{head_port}",
                                 port=middle_port).wait_started()
            for _ in range(args.rounds):
                for kind, namespace, address in (("behind NAT", nat, "10.231.20"), ("reachable", plain, "10.231.21")):
                    tail = NodeProcess("--role", "tail", "--layers", "20-29", "--host", f"{address}.2", *flags,
                                       "--join", f"http://{address}.1:{head_port}", host=f"{address}.2",
                                       netns=namespace).wait_started()
                    try:
                        head.wait_ready(60)
                        _answer(head.url, args.model_id, prompt[:8], 2)
                        runs = [_answer(head.url, args.model_id, prompt, args.tokens) for _ in range(3)]
                        formed = [link["formed"] for link in head.health()["links"] if f"{address}.2:" in link["url"]]
                        print(f"{kind:10} decode tok/s {[round(run, 1) for run in runs]}  head's link: {formed}",
                              flush=True)
                        rates[kind] += runs
                    finally:
                        tail.stop()
                    time.sleep(3)  # the head drops the stopped tail before the next one joins
        finally:
            for node in (middle, head):
                if node is not None:
                    node.stop()
    nat_rate, plain_rate = statistics.median(rates["behind NAT"]), statistics.median(rates["reachable"])
    print(f"median decode tok/s: behind NAT {nat_rate:.1f}, reachable {plain_rate:.1f}; "
          f"per-token time behind NAT / reachable: {plain_rate / nat_rate:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
