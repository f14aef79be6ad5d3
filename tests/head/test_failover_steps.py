"""How a generation routes around failed hops, with the route's channel faked."""

import pytest

from meshws.head.channel import MAX_FAILOVERS, PipelineError, RoutedPath
from meshws.head.generation import GenerationStats
from meshws.model.sampling_params import SamplingParams


class _Path:
    """Re-routes fail with the given errors, in turn; then one succeeds."""

    def __init__(self, failures):
        self.failures = list(failures)
        self.rerouted_around = []
        self.view = [{"node": "somewhere"}]

    async def reroute(self, failure, sampling, prompt_tokens):
        self.rerouted_around.append(failure.url)
        if self.failures:
            raise self.failures.pop(0)


async def test_a_lost_first_hop_of_the_new_route_is_routed_around_too_while_failovers_remain():
    path = _Path([PipelineError("new hop gone", lost=True, url="ws://b")])
    stats = GenerationStats(sid="s")
    await RoutedPath.failover(path, PipelineError("hop gone", lost=True, url="ws://a"), SamplingParams(), 5, stats)
    assert path.rerouted_around == ["ws://a", "ws://b"]
    assert stats.failovers == 2 and stats.route == path.view


async def test_no_route_left_or_no_failovers_left_ends_the_generation():
    no_route = PipelineError("hop gone; and no other route: no route")
    with pytest.raises(PipelineError, match="no other route"):
        await RoutedPath.failover(_Path([no_route]), PipelineError("gone", lost=True, url="ws://a"),
                                  SamplingParams(), 5, GenerationStats(sid="s"))
    always_lost = _Path([PipelineError("gone", lost=True, url=f"ws://{n}") for n in range(10)])
    stats = GenerationStats(sid="s")
    with pytest.raises(PipelineError):
        await RoutedPath.failover(always_lost, PipelineError("gone", lost=True, url="ws://a"), SamplingParams(), 5,
                                  stats)
    assert stats.failovers == MAX_FAILOVERS
