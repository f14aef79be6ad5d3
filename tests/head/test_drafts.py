"""Prompt-lookup drafts and how many the head sends: the rules, without a model."""

from meshws.head.drafts import (COOL_DOWN_LAPS, DRAFTS_UP_TO_GENERATIONS, MISSES_BEFORE_COOL_DOWN, NgramDrafter,
                                Speculation)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter()
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    assert drafter.propose(ids, 3) == [4, 5, 1]  # "1 2 3" was followed by "4 5 1"
    assert drafter.propose(ids + [9], 3) == []  # "2 3 9", "3 9" and "9" never occurred before
    assert drafter.propose([7, 8, 7, 8, 6, 7, 8], 2) == [6, 7]  # the latest occurrence of "7 8" wins
    assert drafter.propose([4, 4, 4], 5) == [4]  # what there is, up to the end
    assert drafter.propose([3, 9, 5, 3], 2) == [], "one matching token is too little to guess from"
    assert drafter.propose(ids, 0) == [] and drafter.propose([1], 3) == []


def test_the_index_follows_a_growing_sequence_and_starts_again_for_another():
    drafter = NgramDrafter()
    ids = [10, 11, 12, 13]
    assert drafter.propose(ids, 2) == []
    ids += [10, 11]
    assert drafter.propose(ids, 2) == [12, 13]
    assert drafter.propose([50, 51, 52, 50, 51], 2) == [52, 50], "a different sequence is indexed afresh"


class Fixed:
    def __init__(self, guesses):
        self.guesses = guesses

    def propose(self, ids, count):
        return self.guesses[:count]


def test_guesses_grow_when_kept_shrink_when_refused_and_pause_after_misses():
    speculation = Speculation(Fixed(list(range(20))), max_tokens=8)
    assert speculation.propose([1], room=10) == [0, 1]  # starts at two
    speculation.record(2, 2)
    assert speculation.k == 4
    speculation.record(4, 4)
    speculation.record(6, 6)
    assert speculation.k == 8  # never beyond --draft-tokens
    assert speculation.propose([1], room=3) == [0, 1, 2], "never guesses past the answer's end"
    speculation.record(8, 3)
    assert speculation.k == 4  # kept 3: the next lap guesses one more than that
    for _ in range(MISSES_BEFORE_COOL_DOWN):
        speculation.record(speculation.k, 0)
    assert [speculation.propose([1], 10) for _ in range(COOL_DOWN_LAPS)] == [[]] * COOL_DOWN_LAPS
    assert speculation.propose([1], 10) == [0]  # after the pause, guessing starts small again
    assert speculation.describe() == {"laps": 6, "draft_tokens": 2 + 4 + 6 + 8 + 4 + 2,
                                      "accepted_draft_tokens": 15, "tokens_per_lap": round(21 / 6, 3)}


def test_no_guesses_while_more_generations_run_than_a_few():
    # A lap with guesses is never batched with other sessions' steps: under load, one-token laps go faster.
    speculation = Speculation(Fixed(list(range(20))), max_tokens=8)
    assert speculation.propose([1], 10, running=DRAFTS_UP_TO_GENERATIONS + 1) == []
    assert speculation.k == 2 and speculation.laps == 0, "skipping guesses changes nothing of the lap count"
    assert speculation.propose([1], 10, running=DRAFTS_UP_TO_GENERATIONS) == [0, 1]
