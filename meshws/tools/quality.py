"""`python -m meshws.tools.quality`: what the fast products cost in quality, measured against exact float32.

Loads the whole model twice in this process, both on the lean path: exactly (`--dtype float32`)
and the fast way, which for a GGUF is the default (8-bit activations times the blocks, as
llama.cpp multiplies) and for a folder's float weights `--quant int8`. It reports:

  * greedy agreement: for each test prompt (the golden tests' chat prompts and a few
    more), how many of the first `--tokens` greedy tokens the fast model shares with
    the exact one before they part, and whether all of them agree;
  * teacher-forced agreement on a fixed text: the share of positions where both
    models' top next-token choice is the same;
  * mean log-likelihood per token of that fixed text under each model.

It prints a table and, with --out, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

import torch

from ..head.conversation import common_prefix

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain in detail how a bicycle works.",
    "List ten fruits and describe the taste of each one.",
    "What is the capital of France?",
    "Give me three tips for writing clear emails.",
    "How do vaccines train the immune system?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a Python function that reverses a string.",
]

TEXT = (
    "The river rises in the hills to the north and runs for some two hundred miles before it reaches the sea. "
    "For most of its length it is slow and wide, and the towns along its banks grew up around the bridges and "
    "the ferries that crossed it. In the spring, when the snow melts, the water can rise by several feet in a "
    "single night, and the old houses near the bank still have marks on their walls that show how high the "
    "great floods came. Farmers grow wheat and barley on the flat land beside the river, and in the autumn the "
    "fields are busy with machines bringing in the harvest. Children learn to swim in the shallow pools below "
    "the weir, and in the evenings people walk along the towpath to watch the boats come home."
)


def greedy(shard: Any, ids: Sequence[int], steps: int, session: str) -> list[int]:
    tokens = [shard.encode_prompt(list(ids), session_id=session).token_id]
    while len(tokens) < steps:
        tokens.append(shard.encode_next_token(tokens[-1], session, history=[*ids, *tokens]).token_id)
    shard.release_session(session)
    return tokens


def text_logits(shard: Any, ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits at every position of `ids` (one stateless pass)."""
    from meshws.model.tensors import positions

    with torch.inference_mode():
        hidden = shard.layers.run(shard.embed(ids), positions(0, len(ids)))
        return shard.last_logits(hidden, len(ids)).float()


def cached_logits(shard: Any, ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits at every position of `ids`, prefilled into a session's cache (its KV dtype counts)."""
    from meshws.model.tensors import positions

    with torch.inference_mode():
        hidden = shard.layers.run(shard.embed(ids), positions(0, len(ids)), "text", "prefill")
        shard.release_session("text")
        return shard.last_logits(hidden, len(ids)).float()


def measure_kv(model: str | None, tokens: int, dtype: str, kv_dtypes: Sequence[str]) -> dict[str, Any]:
    """Keys and values in each of `kv_dtypes` (the first the reference), the products exact: greedy agreement on
    the first five prompts, mean log-likelihood of the fixed text prefilled through the cache, and KV bytes."""
    from meshws.model.shard import ModelShard, ShardSettings
    from meshws.model.source import locate_model

    resolved = locate_model(model)
    shards = {kv: ModelShard(resolved, 0, None, ShardSettings(dtype=dtype, compute="lean", kv_dtype=kv))
              for kv in kv_dtypes}
    reference, tokenizer = shards[kv_dtypes[0]], shards[kv_dtypes[0]].tokenizer
    ids = reference.tokenize(TEXT)
    targets = torch.tensor(ids[1:])
    result: dict[str, Any] = {"model": resolved.model_id, "dtype": dtype, "tokens": tokens, "kv": {}}
    prompts = [reference.tokenize(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                add_generation_prompt=True, tokenize=False))
               for text in PROMPTS[:5]]
    wanted = [greedy(reference, prompt, tokens, "want") for prompt in prompts]
    for kv, shard in shards.items():
        logits = cached_logits(shard, ids)[:-1]
        shard.encode_prompt(ids, session_id="size")
        got = [greedy(shard, prompt, tokens, "got") for prompt in prompts]
        result["kv"][kv] = {
            "mean_loglik": float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).mean()),
            "identical_answers": sum(a == b for a, b in zip(got, wanted)), "answers": len(prompts),
            "shared_prefixes": [common_prefix(a, b) for a, b in zip(got, wanted)],
            "kv_bytes_per_token": shard.sessions.total_bytes / 64 / -(-len(ids) // 64)}
        shard.release_session("size")
    base = result["kv"][kv_dtypes[0]]["mean_loglik"]
    for entry in result["kv"].values():
        entry["loglik_change"] = round(abs(entry["mean_loglik"] - base) / abs(base), 5)
    return result


def measure(model: str | None, tokens: int, dtype: str) -> dict[str, Any]:
    from meshws.model.shard import ModelShard, ShardSettings
    from meshws.model.source import locate_model

    resolved = locate_model(model)
    float_shard = ModelShard(resolved, 0, None, ShardSettings(dtype=dtype, compute="lean"))
    fast = ShardSettings(dtype="auto", compute="lean") if resolved.gguf is not None else \
        ShardSettings(dtype=dtype, compute="lean", quant="int8")
    int8_shard = ModelShard(resolved, 0, None, fast)
    tokenizer = float_shard.tokenizer
    prompts = []
    for text in PROMPTS:
        ids = float_shard.tokenize(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                 add_generation_prompt=True, tokenize=False))
        want = greedy(float_shard, ids, tokens, "float")
        got = greedy(int8_shard, ids, tokens, "int8")
        prompts.append({"prompt": text, "shared_prefix": common_prefix(want, got), "all_agree": want == got})
    ids = float_shard.tokenize(TEXT)
    targets = torch.tensor(ids[1:])
    result: dict[str, Any] = {"model": resolved.model_id, "dtype": dtype, "tokens": tokens, "prompts": prompts,
                              "text_tokens": len(ids) - 1, "fast": int8_shard.compute_path}
    top = {}
    for name, shard in (("float", float_shard), ("int8", int8_shard)):
        logits = text_logits(shard, ids)[:-1]
        result[f"mean_loglik_{name}"] = float(torch.log_softmax(logits, -1).gather(1, targets[:, None]).mean())
        top[name] = logits.argmax(-1)
    result["teacher_forced_top1_agreement"] = float((top["float"] == top["int8"]).float().mean())
    result["weight_bytes"] = {"float": float_shard.weight_bytes, "int8": int8_shard.weight_bytes}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshws.tools.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=None, help="where to write the JSON")
    parser.add_argument("--kv", nargs="+", default=None, metavar="KV_DTYPE",
                        help="compare keys and values in these dtypes instead (the first the reference), e.g. "
                        "--kv bfloat16 q8_0 (issue 63: log-likelihood within 0.5%%, 4 of 5 answers the same)")
    args = parser.parse_args(argv)
    if args.kv:
        result = measure_kv(args.model, args.tokens, args.dtype, args.kv)
        print(json.dumps(result, indent=1))
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(result, handle, indent=2)
        return 0
    result = measure(args.model, args.tokens, args.dtype)
    print(f"{result['model']} ({result['dtype']} vs {result['fast']}), {result['tokens']} greedy tokens per prompt")
    for row in result["prompts"]:
        print(f"  {row['shared_prefix']:>3}/{result['tokens']} {'same' if row['all_agree'] else 'parts'}  "
              f"{row['prompt']}")
    same = sum(row["all_agree"] for row in result["prompts"])
    print(f"prompts with identical output: {same}/{len(result['prompts'])}")
    print(f"fixed text ({result['text_tokens']} tokens): mean log-likelihood float {result['mean_loglik_float']:.4f}, "
          f"fast {result['mean_loglik_int8']:.4f}; top-1 agreement {result['teacher_forced_top1_agreement']:.3f}")
    print(f"weights: exact {result['weight_bytes']['float'] / 2**20:.0f} MiB, "
          f"fast {result['weight_bytes']['int8'] / 2**20:.0f} MiB")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
