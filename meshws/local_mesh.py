"""Start a whole mesh on this machine: `python -m meshws.local_mesh` (what `./dev mesh` runs).

Starts a tail and a head as separate processes (real websockets on loopback),
splitting the model's layers between them, waits until the head reports the
chain complete, prints where to chat, and stops both on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def total_layers(model: str, cache_dir: str | None) -> int:
    from transformers import AutoConfig

    from .model_source import resolve_model

    print(f"preparing the model ({model}); the first run converts it once, later runs take a second", flush=True)
    resolved = resolve_model(model, cache_dir)
    return AutoConfig.from_pretrained(str(resolved.folder)).num_hidden_layers


def wait_ready(port: int, processes: list[subprocess.Popen], timeout: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        if any(process.poll() is not None for process in processes):
            raise SystemExit("a node exited during start-up; see its output above")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                last = json.loads(response.read())
            if last.get("ready"):
                return last
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the mesh did not become ready: {last.get('problems')}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshws.local_mesh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="as for meshws.node --model")
    parser.add_argument("--port", type=int, default=8700, help="the head's port (the tail takes the next one)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--api-key", default=None, help="require this key on the public API")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    layers = total_layers(args.model, os.environ.get("MESHWS_CACHE_DIR"))
    split = layers // 2
    head_port, tail_port = args.port, args.port + 1
    common = ["--model", args.model, "--dtype", args.dtype, "--host", "127.0.0.1"]
    threads = str(max(1, (os.cpu_count() or 2)))
    tail = subprocess.Popen([sys.executable, "-m", "meshws.node", "--role", "tail", "--layers",
                             f"{split}-{layers - 1}", "--port", str(tail_port), "--threads", threads, *common])
    head_args = ["--role", "head", "--layers", f"0-{split - 1}", "--port", str(head_port), "--threads", threads,
                 "--peer", f"ws://127.0.0.1:{tail_port}", *common]
    if args.api_key:
        head_args += ["--api-key", args.api_key]
    head = subprocess.Popen([sys.executable, "-m", "meshws.node", *head_args])
    processes = [head, tail]
    try:
        health = wait_ready(head_port, processes)
        chain = ", ".join(f"{hop['node']} layers {hop['layers'][0]}-{hop['layers'][1] - 1}" for hop in health["chain"])
        print(f"\nmeshws local mesh ready: {chain}")
        print(f"  chat page:   http://127.0.0.1:{head_port}/")
        print(f"  OpenAI API:  http://127.0.0.1:{head_port}/v1  (model {health['model']!r})")
        print(f"  terminal:    python examples/ws_client.py --url ws://127.0.0.1:{head_port}")
        print("Ctrl-C stops both nodes.", flush=True)
        while all(process.poll() is None for process in processes):
            time.sleep(0.5)
        print("a node exited; stopping the mesh", file=sys.stderr)
    except KeyboardInterrupt:
        pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
