"""A step with drafts yields exactly the tokens of one-by-one decoding, and its extra positions are cut back."""

import pytest

from meshws.model.backend import PrefillStep, run_prefill
from meshws.model.text.sampling_params import SamplingParams
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


def test_a_grammar_masks_each_row_so_a_draft_it_forbids_is_rejected(full):
    """Under a grammar that allows only digits, the tail's choice is a digit even where the model's favourite
    is a word, a guessed word is rejected like any wrong guess, and the matcher advanced by the choices only."""
    import llguidance
    import torch

    from meshws.model.text.constraints import Grammars
    from meshws.model.text.sampling import sample_token, verify_drafts

    grammars = Grammars(lambda: full.tokenizer, full.vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_regex(r"[0-9]{1,8}")
    word, digit = full.tokenize(" hello")[0], full.tokenize("7")[0]
    logits = torch.zeros(3, full.vocab_size)
    logits[:, word] = 10.0  # the model would say the word at every row
    logits[:, digit] = 5.0
    greedy = SamplingParams(temperature=0)
    matcher = grammars.matcher(grammar, [])
    assert sample_token(logits[0].clone(), greedy, 0, constraint=matcher) == digit and matcher.consumed == [digit]
    matcher = grammars.matcher(grammar, [digit])  # a new state: one digit already generated
    assert verify_drafts(logits.clone(), greedy, 0, [word, word], constraint=matcher) == [digit]  # guess rejected
    assert matcher.consumed == [digit, digit]
    grammars.keep(grammar, matcher)
    assert grammars.matcher(grammar, [digit, digit, digit]) is matcher  # found again a lap behind, then advanced
    assert matcher.consumed == [digit] * 3
    with pytest.raises(ValueError):
        grammars.matcher(grammar, [word])  # a history the grammar forbids
