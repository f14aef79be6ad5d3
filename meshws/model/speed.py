"""A node's measured speed: seconds per mean layer per token (`costs.ModelCosts.units`) on this CPU and these blocks.

`SpeedMeter` keeps the recent samples: each lone decode step the node really runs (its time over its span's
units), and a probe's when the node has run none for a while (a probe weighs as `STEADY_STEPS` steps: it is
the mean of the steps that fit in its time). What it reports is the median of the last `window` seconds,
reaching back past them to the newest `STEADY_STEPS` steps' worth when fewer came, so one slow step (a
collection, a page fault) moves nothing while a machine that slows down (a throttled laptop, a build beside it,
a CPU quota) shows within seconds. A node busy with batches times no lone step: its few at a run's start and
end, beside other sessions' prompts, are weighed with those before them, not alone (alone they read up to 2x
apart, and a head re-planned on each).

`probe` times a few one-token steps of a session of its own on the node's shard: on a CPU quota a step may fall
inside one slice of it, so the probe runs steps until `min_seconds` have passed and reports their mean.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Any, Callable

import torch

WINDOW_SECONDS = 6.0  # the seconds of samples the reported speed is the median of (STEADY_STEPS' worth at least)
MAX_SAMPLES = 256
STEADY_STEPS = 32  # the fewest lone steps the reported median is taken over (reaching back past the window)


class SpeedMeter:
    def __init__(self, window: float = WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=MAX_SAMPLES)  # (when, s per mean layer, weight)
        self.source = "none"  # what the last sample was: "probe" or "steps"
        self.last_sample = float("-inf")  # when it came (this meter's clock)

    def record(self, seconds: float, units: float, source: str = "steps", weight: float = 1.0) -> None:
        """One step of `seconds` over a span of `units` mean layers, weighing as `weight` steps (a step that ran
        nothing is ignored)."""
        if units <= 0 or not 0 < seconds < float("inf") or not weight > 0:
            return
        now = self._clock()
        self._samples.append((now, seconds / units, weight))
        self.source, self.last_sample = source, now

    @property
    def layer_seconds(self) -> float | None:
        """The weighted median of the window's samples and, while they weigh less than STEADY_STEPS, of the
        newest before them up to that weight; None before any."""
        cutoff, taken, weight = self._clock() - self.window, [], 0.0
        for when, value, steps in reversed(self._samples):
            if when < cutoff and weight >= STEADY_STEPS:
                break
            taken.append((value, steps))
            weight += steps
        if not taken:
            return None
        taken.sort()
        half, reached = weight / 2, 0.0
        for index, (value, steps) in enumerate(taken[:-1]):
            reached += steps
            if reached > half:
                return value
            if reached == half:  # (two probes, or an even count of steps: the mean of the middle two)
                return (value + taken[index + 1][0]) / 2
        return taken[-1][0]

    def idle_for(self) -> float:
        """Seconds since the last sample."""
        return self._clock() - self.last_sample

    def describe(self) -> dict[str, Any]:
        value = self.layer_seconds
        return {"layer_ms": None if value is None else round(value * 1000, 4), "source": self.source,
                "samples": sum(1 for when, _, _ in self._samples if when >= self._clock() - self.window)}


def probe(shard: Any, min_seconds: float = 0.15, max_steps: int = 32) -> tuple[float, float]:
    """Seconds per one-token decode step through `shard` (a `ShardBackend`), and of them the LM head's (a tail's),
    on a private session of its own (no user's: neither counted nor able to evict one) released after: a prefill of one
    position, then decode steps until `min_seconds` have passed (two at least)."""
    sid = f"probe-{uuid.uuid4().hex}"
    token = 1 % max(1, shard.vocab_size)
    hidden = torch.randn(1, 1, shard.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.1
    body = hidden.numpy().tobytes()  # (float32 on the wire: widened or narrowed to the shard's own dtype)

    def step(past: int) -> None:
        mode = "prefill" if past == 0 else "decode"
        if shard.is_head and past == 0:
            shard.encode_prompt([token], sid)
        elif shard.is_head:
            shard.encode_next_token(token, sid, past_len=past)
        else:
            shard.forward_bytes(body, (1, 1, shard.hidden_size), dtype="float32", session_id=sid, cache_mode=mode,
                                past_len=past)

    with shard.sessions.private(sid):
        step(0)
        steps, began, lm_head = 0, time.perf_counter(), shard.lm_head_seconds
        while steps < 2 or (time.perf_counter() - began < min_seconds and steps < max_steps):
            steps += 1
            step(steps)
        return (time.perf_counter() - began) / steps, (shard.lm_head_seconds - lm_head) / steps
