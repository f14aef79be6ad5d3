"""`--compile`: the lean path through torch.compile gives the eager lean path's tokens.

Marked slow: a cold compile takes about a minute on a 2-core machine (the CI run starts
with an empty inductor cache). Run with `./dev test -m slow`.
"""

import pytest

from meshws.model.backend import DecodeStep
from meshws.model.shard import ModelShard, ShardSettings

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


@pytest.mark.parametrize("quant", [None, "int8"])
def test_compiled_lean_path_gives_the_eager_tokens(embedded_model, tmp_path, quant):
    eager = ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32", compute="lean", quant=quant))
    compiled = ModelShard(embedded_model, 0, 30,
                          ShardSettings(dtype="float32", compute="lean", compile=True, quant=quant), cache_dir=tmp_path)
    assert compiled.compute_path.endswith("compiled") and compiled.compile_seconds > 0
    assert compiled.compute_facts["compile_seconds"] == compiled.compile_seconds
    assert compiled.sessions.total_bytes == 0, "the warm-up sessions are released"
    prompts = [eager.tokenize("The capital of France is"), eager.tokenize("def fibonacci(n):")]
    results = {}
    for name, shard in (("eager", eager), ("compiled", compiled)):
        rows = [[shard.encode_prompt(ids, session_id=f"{name}-{index}").token_id] for index, ids in enumerate(prompts)]
        for _ in range(8):  # batched steps: the compiled graphs with two rows
            steps = [DecodeStep(f"{name}-{index}", token_id=tokens[-1]) for index, tokens in enumerate(rows)]
            for tokens, result in zip(rows, shard.decode_batch(steps)):
                tokens.append(result.token_id)
        tokens = rows[0]
        for _ in range(4):  # and one session alone
            tokens.append(shard.encode_next_token(tokens[-1], f"{name}-0").token_id)
        results[name] = rows
    if quant is None:
        assert results["compiled"] == results["eager"]
    else:  # inductor's fused norms round differently, and int8 rows amplify that: the outputs part later
        for compiled_row, eager_row in zip(results["compiled"], results["eager"]):
            assert compiled_row[:4] == eager_row[:4]
