"""`python -m meshws.bench --tls`: what TLS costs a head + tail mesh in decode tokens per second.

Makes a certificate authority and a loopback certificate for the run (needs `trustme`,
`pip install trustme`), starts the same head + tail twice — over `ws://` and over
`wss://` with `--tls-ca` — and measures one session on each in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import tempfile
from pathlib import Path
from typing import Any

from .launch import Mesh
from .streams import sessions_run, stream_once


def measure_tls(args: argparse.Namespace, dtype: str, prompt_ids: list[int], model_id: str) -> dict[str, Any]:
    try:
        import trustme
    except ImportError as exc:
        raise SystemExit("--tls needs trustme to make a certificate authority: pip install trustme") from exc
    with tempfile.TemporaryDirectory() as folder:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        paths = {name: str(Path(folder) / f"{name}.pem") for name in ("ca", "cert", "key")}
        ca.cert_pem.write_to_path(paths["ca"])
        cert.cert_chain_pems[0].write_to_path(paths["cert"])
        cert.private_key_pem.write_to_path(paths["key"])
        context = ssl.create_default_context(cafile=paths["ca"])
        split = args.tail_start
        specs = [("head", f"0-{split - 1}"), ("tail", f"{split}-{args.layers - 1}")]
        tls = ("--tls-cert", paths["cert"], "--tls-key", paths["key"], "--tls-ca", paths["ca"])
        result: dict[str, Any] = {}
        for name, extra in (("plain", ()), ("tls", tls)):
            mesh = Mesh(specs, common=("--model", args.model, "--dtype", dtype, *extra), ca=paths["ca"])
            try:
                asyncio.run(stream_once(mesh.head.url, model_id, prompt_ids, 4, ssl=context))  # warm-up
                run = asyncio.run(sessions_run(mesh.head.url, model_id, prompt_ids, args.tokens, 1, ssl=context))
                result[f"{name}_tok_s"] = run["per_session_tok_s"]
            finally:
                mesh.stop()
    result["tls_over_plain"] = round(result["tls_tok_s"] / result["plain_tok_s"], 3)
    return result
