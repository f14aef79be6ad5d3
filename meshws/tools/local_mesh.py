"""Start a whole mesh on this machine: `meshws mesh` (what `./dev mesh` runs).

Starts a tail and a head as separate processes (real websockets on loopback),
splitting the model's layers between them so that each reads about the same weight
bytes a step (`tail_start`), waits until the head reports the chain complete, prints
where to chat, and stops both on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from .launch import Mesh


def model_shape(model: str, cache_dir: str | None) -> dict[str, int]:
    from ..model.source import locate_model, model_shape as shape

    return shape(locate_model(model, cache_dir))


def tail_start(shape: dict[str, int]) -> int:
    """The tail's first layer in a head + tail split where both read about the same weight bytes a step: the tail
    also reads the LM head (vocabulary x hidden). For SmolLM2-135M that matrix weighs 8 of its 30 layers, so the
    head runs 0-18 and the tail 19-29. Halving the layers (0-14, 15-29) left the tail the bottleneck under load:
    16 sessions in bf16 kept it busy 0.93 of the time against the head's 0.73, at 4.5x one session's tok/s; the
    split by bytes gave 0.87 and 0.79, and 4.6-4.9x. At least one layer stays on each node."""
    layers, hidden, dim = shape["layers"], shape["hidden"], shape["head_dim"]
    layer = hidden * dim * (2 * shape["heads"] + 2 * shape["kv_heads"]) + 3 * hidden * shape["intermediate"]
    lm_head = shape["vocab"] * hidden / layer  # in layers
    return min(layers - 1, max(1, round((layers + lm_head) / 2)))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None, prog: str = "python -m meshws.tools.local_mesh") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="as for meshws.node --model")
    parser.add_argument("--port", type=int, default=8700, help="the head's port (the tail takes the next one)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="as for meshws.node --dtype (auto: bf16 only where the CPU has it natively)")
    parser.add_argument("--api-key", default=None, help="require this key on the public API")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the nodes too, as Ctrl-C does
    shape = model_shape(args.model, os.environ.get("MESHWS_CACHE_DIR"))
    layers, split = shape["layers"], tail_start(shape)
    head_extra = ("--api-key", args.api_key) if args.api_key else ()
    mesh = Mesh(
        [("head", f"0-{split - 1}"), ("tail", f"{split}-{layers - 1}")],
        common=("--model", args.model, "--dtype", args.dtype),
        extra={"head": head_extra},
        ports=[args.port, args.port + 1],
        echo=True,
        timeout=300.0,
    )
    try:
        health = mesh.head.health()
        chain = ", ".join(f"{hop['node']} layers {hop['layers'][0]}-{hop['layers'][1] - 1}" for hop in health["chain"])
        print(f"\nmeshws local mesh ready: {chain}")
        print(f"  chat page:   {mesh.head.url}/")
        print(f"  OpenAI API:  {mesh.head.url}/v1  (model {health['model']!r})")
        print(f"  terminal:    python examples/ws_client.py --url {mesh.head.ws_url}")
        print("Ctrl-C stops both nodes.", flush=True)
        while mesh.running():
            time.sleep(0.5)
        print("a node exited; stopping the mesh", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        mesh.stop()


if __name__ == "__main__":
    main()
