"""The planner prefers a direct or reversed hop to one the head must relay (neither side can dial the other)."""

from types import SimpleNamespace

from meshws.head.planner import RELAYED_HOP_COST, RoutePlanner
from meshws.head.registry import Registry
from meshws.head.routes import NodeRecord, plan_hops
from meshws.mesh.link_pool import LinkPool

MIDDLE = NodeRecord(url="ws://10.0.0.2:1", node="middle@a", model="m", layers=(10, 20), role="middle")
NAT_TAIL = NodeRecord(url="ws://10.0.0.3:1", node="tail@b", model="m", layers=(20, 30))
OPEN_TAIL = NodeRecord(url="ws://10.0.0.4:1", node="tail@c", model="m", layers=(20, 30), load=5)


def test_a_hop_cost_weighs_in_among_routes_of_as_many_hops():
    records = [MIDDLE, NAT_TAIL, OPEN_TAIL]
    load = lambda record: record.load  # noqa: E731
    assert plan_hops(records, 10, 30, load) == [MIDDLE, NAT_TAIL]  # the less loaded tail
    relayed = lambda before, record: 8.0 if (before, record) == (MIDDLE, NAT_TAIL) else 0.0  # noqa: E731
    assert plan_hops(records, 10, 30, load, hop_cost=relayed) == [MIDDLE, OPEN_TAIL]


def _link(reversed_=False, up=True, failures=0):
    return SimpleNamespace(reversed=reversed_, is_up=up, dial_failures=failures, start=lambda: None)


def _pool(links):
    """A node's links as the planner finds them: one per joined node (the head links to each on its join)."""
    pool = LinkPool(links.__getitem__)
    for url in links:
        pool.get(url)
    return pool


def test_the_planner_counts_a_hop_between_two_nodes_it_cannot_dial_as_relayed():
    links = {MIDDLE.url: _link(reversed_=True), NAT_TAIL.url: _link(reversed_=True), OPEN_TAIL.url: _link()}
    planner = RoutePlanner("head@x", lambda: (0, 10), 30, "m", _pool(links), Registry("m", 30), None, False)
    assert planner._hop_cost(MIDDLE, NAT_TAIL) == RELAYED_HOP_COST
    assert planner._hop_cost(MIDDLE, OPEN_TAIL) == 0.0  # reversed then dialed: no relay
    assert planner._hop_cost(None, MIDDLE) == 0.0  # the head's own link: reversed is as good as dialed
    links[NAT_TAIL.url] = _link(up=False, failures=2)  # not dialable yet, not reversed yet: as good as relayed
    planner.links = _pool(links)
    assert planner._hop_cost(MIDDLE, NAT_TAIL) == RELAYED_HOP_COST
