"""The `meshws` command: `meshws node ...`, `meshws mesh ...`, `meshws bench ...`, `meshws --version`."""

from __future__ import annotations

import sys

from . import __version__

USAGE = """usage: meshws [--version] {node,mesh,bench} ...

  meshws node ...    start one node (the same as python -m meshws.node; see meshws node --help)
  meshws mesh ...    start a head and a tail on this machine and serve the chat page
  meshws bench ...   measure meshws against in-process generate() (python -m meshws.bench)
"""


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args else ""
    if command in ("--version", "-V"):
        print(f"meshws {__version__}")
    elif command == "node":
        from . import early

        early.start(args)  # (kernels compile on a first start, a head's tokenizer builds, while the node imports)
        from .node import main as node_main

        node_main(args, prog="meshws node")
    elif command == "mesh":
        from .tools.local_mesh import main as mesh_main

        mesh_main(args, prog="meshws mesh")
    elif command == "bench":
        from .tools.bench import main as bench_main

        bench_main(args, prog="meshws bench")
    else:
        print(USAGE, end="", file=sys.stdout if command in ("-h", "--help") else sys.stderr)
        raise SystemExit(0 if command in ("-h", "--help") else 2)


if __name__ == "__main__":
    main()
