"""What several test files share: the test prompts, golden generation, a completion request, fresh caches."""

import contextlib
import json
import shutil
from pathlib import Path

import aiohttp
import torch

from meshws.tools.namespaces import other_host  # noqa: F401 (the system tests' other hosts)

ROOT = Path(__file__).resolve().parent.parent  # the repository
MODEL = "SmolLM2-135M-Instruct"
EXACT = ("--dtype", "float32")  # float32 links by default (`--wire-dtype auto`)
SECRET = "mesh-secret-for-the-tests-0123"  # the `secret_file` fixture's
CHAT_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain in detail how a bicycle works.",
    "List ten fruits and describe the taste of each one.",
]


def chat_ids(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def golden(reference_model, ids, steps):
    with torch.inference_mode():
        out = reference_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=steps)[0, len(ids):]
    return [t for t in out.tolist() if t != 2]  # the mesh stops on EOS and does not return it


async def complete_ids(url, ids, max_tokens, **extra):
    body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            **extra}
    async with aiohttp.ClientSession() as client:
        async with client.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
    return answer["choices"][0]["token_ids"], answer["choices"][0]["text"]


def cache_of_its_own(resolved, root):
    """`resolved` (a GGUF model) in a new cache folder under `root` holding only its tokenizer (copied with its
    mtimes), as a head that has started once leaves it."""
    from meshws.model.gguf.model_files import MANIFEST
    from meshws.model.source import ResolvedModel

    target = Path(root) / resolved.folder.name
    target.mkdir(parents=True)
    manifest = json.loads((resolved.folder / MANIFEST).read_text())
    parts = {key: files for key, files in manifest["parts"].items() if key == "tokenizer"}
    for files in parts.values():
        for name in files:
            shutil.copy2(resolved.folder / name, target / name)
    (target / MANIFEST).write_text(json.dumps(dict(manifest, parts=parts)))
    return ResolvedModel(resolved.model_id, target, resolved.gguf)


def run_chain(shards, ids, steps, session):
    """Greedy tokens through a chain of in-process shards, driven as the mesh drives them: prefill, then
    one-token steps; every shard's cache of the session is released at the end."""
    tokens = []
    result = shards[0].encode_prompt(ids, session_id=session)
    mode = "prefill"
    while True:
        for shard in shards[1:]:
            result = shard.forward_bytes(result.body, result.shape, dtype=result.dtype, session_id=session,
                                         cache_mode=mode, past_len=result.past_len)
        tokens.append(result.token_id)
        if len(tokens) == steps:
            for shard in shards:
                shard.release_session(session)
            return tokens
        result = shards[0].encode_next_token(tokens[-1], session)
        mode = "decode"


@contextlib.asynccontextmanager
async def serving(app):
    """An aiohttp app served on a free loopback port while the block runs: its http:// base."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()
