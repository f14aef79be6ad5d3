"""How a generation routes around failed hops, with the route's channel faked."""

import pytest

from meshws.head.channel import MAX_FAILOVERS, PipelineError, RoutedPath
from meshws.head.generation import GenerationStats
from meshws.model.text.sampling_params import SamplingParams


class _Path:
    """Re-routes fail with the given errors, in turn; then one succeeds."""

    def __init__(self, failures, standby_holds=0):
        self.failures = list(failures)
        self.rerouted_around = []
        self.view = [{"node": "somewhere"}]
        self.standby_holds = standby_holds  # what `resume_on_standby` finds

    async def resume_on_standby(self, failure, sampling, prompt_tokens):
        return self.standby_holds

    async def reroute(self, failure, sampling, prompt_tokens):
        self.rerouted_around.append(failure.url)
        if self.failures:
            raise self.failures.pop(0)


async def test_a_lost_first_hop_of_the_new_route_is_routed_around_too_while_failovers_remain():
    path = _Path([PipelineError("new hop gone", lost=True, url="ws://b")])
    stats = GenerationStats(sid="s")
    assert await RoutedPath.failover(path, PipelineError("hop gone", lost=True, url="ws://a"), SamplingParams(), 5,
                                     stats, 40, 41) == 0
    assert path.rerouted_around == ["ws://a", "ws://b"]
    assert stats.failovers == 2 and stats.route == path.view
    assert stats.recomputed_tokens == 41 and stats.standby_resumes == 0  # the 41 positions ran again


async def test_a_standby_holding_the_session_resumes_it_from_what_it_holds():
    path, stats = _Path([], standby_holds=44), GenerationStats(sid="s")
    kept = await RoutedPath.failover(path, PipelineError("tail gone", lost=True, url="ws://a"), SamplingParams(), 5,
                                     stats, 40, 41)
    assert kept == 40 and path.rerouted_around == []  # no more than the caches hold: the head's 40
    assert stats.standby_resumes == 1 and stats.recomputed_tokens == 1


async def test_no_route_left_or_no_failovers_left_ends_the_generation():
    no_route = PipelineError("hop gone; and no other route: no route")
    with pytest.raises(PipelineError, match="no other route"):
        await RoutedPath.failover(_Path([no_route]), PipelineError("gone", lost=True, url="ws://a"),
                                  SamplingParams(), 5, GenerationStats(sid="s"), 0, 1)
    always_lost = _Path([PipelineError("gone", lost=True, url=f"ws://{n}") for n in range(10)])
    stats = GenerationStats(sid="s")
    with pytest.raises(PipelineError):
        await RoutedPath.failover(always_lost, PipelineError("gone", lost=True, url="ws://a"), SamplingParams(), 5,
                                  stats, 0, 1)
    assert stats.failovers == MAX_FAILOVERS
