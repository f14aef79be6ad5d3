"""A step with drafts yields exactly the tokens of one-by-one decoding, and its extra positions are cut back."""

import pytest

from meshws.model.backend import PrefillStep, run_prefill
from meshws.model.sampling import SamplingParams
from meshws.model.shard import ModelShard, ShardSettings

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def full(embedded_model):
    return ModelShard(embedded_model, 0, 30, ShardSettings(dtype="float32"))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=5),
                                      SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.6)],
                         ids=["greedy", "seeded", "penalties"])
def test_drafts_yield_the_one_by_one_tokens(full, sampling):
    prompt = full.tokenize("One, two, three, four, five, six, seven, eight")
    n = len(prompt)
    one_by_one = [full.encode_prompt(prompt, "a", sampling=sampling, generated_from=n).token_id]
    for _ in range(5):
        one_by_one.append(full.encode_next_token(one_by_one[-1], "a", sampling=sampling,
                                                 history=prompt + one_by_one, generated_from=n).token_id)

    first = full.encode_prompt(prompt, "b", sampling=sampling, generated_from=n).token_id
    assert first == one_by_one[0]
    drafts = [one_by_one[1], one_by_one[2], (one_by_one[3] + 1) % full.vocab_size]  # the third guess is wrong
    step = PrefillStep("b", token_ids=[first, *drafts], mode="decode", past_len=n, sampling=sampling,
                       history=prompt + [first], generated_from=n, drafts=drafts)
    result = run_prefill(full, step, 256)
    assert list(result.token_ids) == one_by_one[1:4] and result.token_id == one_by_one[3]
    assert full.sessions.lookup("b").seq_len == n + 4  # every position ran; the wrong guess's is cut back next
    following = full.encode_next_token(one_by_one[3], "b", sampling=sampling, history=prompt + one_by_one[:4],
                                       generated_from=n, past_len=n + 3)
    assert following.token_id == one_by_one[4]
    assert full.sessions.lookup("b").seq_len == n + 4  # prompt + the tokens fed: exactly what was kept

    all_right = run_prefill(full, PrefillStep("b", token_ids=[one_by_one[4]], mode="decode", past_len=n + 4,
                                              sampling=sampling, history=prompt + one_by_one[:5], generated_from=n),
                            256)
    assert all_right.token_id == one_by_one[5]
    for session in ("a", "b"):
        full.release_session(session)
