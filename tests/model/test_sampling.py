"""Choosing the next token: greedy, seeded sampling per position, top-k/top-p, penalties, wire form."""

import pytest
import torch

from meshws.model.text.sampling_params import SamplingParams
from meshws.model.text.sampling import greedy_choice, sample_token, token_logprobs


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample_token(logits, SamplingParams(), position=0) == 1


@pytest.mark.parametrize("temperature", [1e-38, 1e-20, 9e-6])
def test_a_temperature_too_small_to_divide_by_decodes_greedily(temperature):
    """Logits over 1e-38 overflow to infinities and their softmax is NaN: below 1e-5 the choice is argmax's (as
    vLLM's), where sampling used to raise; the log-probabilities reported are the model's own (temperature 1)."""
    logits = torch.tensor([0.1, 30.0, 29.0, -1.0])  # (30 / 1e-38 overflows float32)
    params = SamplingParams(temperature=temperature, seed=3)
    assert [sample_token(logits, params, position=p) for p in range(5)] == [1] * 5
    (logprob, _), = token_logprobs(logits.unsqueeze(0), params, [1])
    assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))


def test_seeded_sampling_is_reproducible_per_position():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=42)
    first = [sample_token(logits, params, position=p) for p in range(20)]
    again = [sample_token(logits, params, position=p) for p in range(20)]
    other = [sample_token(logits, SamplingParams(temperature=1.0, seed=43), position=p) for p in range(20)]
    assert first == again
    assert first != other


def test_top_k_and_top_p_restrict_the_choice():
    logits = torch.tensor([5.0, 4.9, 4.8, 0.0, -1.0])
    draws = {sample_token(logits, SamplingParams(temperature=5.0, top_k=2, seed=s), position=0) for s in range(200)}
    assert draws == {0, 1}
    probs_first = torch.tensor([10.0, 0.0, 0.0, 0.0])
    draws = {sample_token(probs_first, SamplingParams(temperature=1.0, top_p=0.5, seed=s), 0) for s in range(50)}
    assert draws == {0}


def test_repetition_and_frequency_penalties_change_the_choice():
    logits = torch.tensor([2.0, 1.9, 0.0])
    assert sample_token(logits, SamplingParams(repetition_penalty=1.5), 3, history=[0, 2]) == 1
    assert sample_token(logits, SamplingParams(frequency_penalty=0.2), 3, history=[5, 0], generated_from=1) == 1
    # Prompt tokens do not count for the OpenAI-style penalties.
    assert sample_token(logits, SamplingParams(frequency_penalty=0.2), 3, history=[0, 1], generated_from=2) == 0


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"temperature": "hot"}, "number"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 1.5}, "number"),
        ({"volume": 11}, "unknown"),
        ("greedy", "object"),
    ],
)
def test_sampling_from_wire_rejects_bad_fields(data, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams.from_wire(data)


def test_sampling_wire_round_trip():
    params = SamplingParams(temperature=0.7, top_k=40, seed=3)
    assert params.to_wire() == {"temperature": 0.7, "top_k": 40, "seed": 3}
    assert SamplingParams.from_wire(params.to_wire()) == params


def test_prompt_logprobs_come_block_by_block_as_if_at_once():
    """Each prompt token's log-probability from the row before it, computed a block of rows at a time (a long
    prompt's vocab-wide rows are never all held): the same figures as one log_softmax over every row."""
    from meshws.model.text.sampling import PROMPT_LOGPROB_ROWS, prompt_token_logprobs

    torch.manual_seed(0)
    vocab, positions = 50, PROMPT_LOGPROB_ROWS * 2 + 7
    head = torch.randn(8, vocab)
    hidden = torch.randn(1, positions, 8)
    history = torch.randint(0, vocab, (positions,)).tolist()
    calls = []

    def logits_of(rows, count):
        calls.append(count)
        return rows[0, -count:] @ head

    params = SamplingParams(logprobs=2, prompt_logprobs=True)
    got = prompt_token_logprobs(logits_of, hidden, 0, params, history, positions)
    want = torch.log_softmax(hidden[0] @ head, dim=-1)
    assert len(got) == positions - 1 and max(calls) <= PROMPT_LOGPROB_ROWS and len(calls) == 3
    for row, (logprob, top) in enumerate(got):
        assert abs(logprob - float(want[row, history[row + 1]])) < 1e-5
        assert [token for token, _ in top] == want[row].topk(2).indices.tolist()
    assert prompt_token_logprobs(logits_of, hidden, 0, SamplingParams(logprobs=2), history, positions) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_greedy_choice_is_torch_argmax_ties_nan_and_views_included(dtype):
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(40, 49152, generator=generator).to(dtype)
    rows[1, 700] = rows[1, 900] = rows[1].max() + 1  # a tie: the first wins
    rows[2, 5] = float("nan")  # a NaN counts as largest
    rows[3] = float("-inf")
    rows[4, :] = 1.0
    rows[5, 20000] = float("inf")
    if dtype == torch.bfloat16:
        rows[6, 10], rows[6, 11] = 1000.0, 1001.0  # both 1000 in bf16: still the first, as torch picks
    for row in [*rows, rows[:, 7], rows[7, ::3]]:  # whole rows, a column, a strided view
        assert greedy_choice(row) == int(torch.argmax(row))
    assert sample_token(rows[1], SamplingParams(temperature=0.0), 0) == 700
