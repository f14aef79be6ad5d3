"""Where a lap's time goes (head/timing.py): each link's share from what the hops report."""

import pytest

from meshws.head.timing import LapTimes, RecentLaps, links_of
from meshws.mesh.metrics import busy_share
from meshws.mesh.wire import HopReport


def test_each_link_is_what_the_hop_before_waited_less_the_rest():
    # head waited 30 ms: middle computed 10, then waited 14 for the tail, which computed 9
    hops = [HopReport("middle", 10.0, 5, 14.0), HopReport("tail", 9.0, 5)]
    assert links_of(30.0, hops) == [(("head", "middle"), pytest.approx(6.0)), (("middle", "tail"), pytest.approx(5.0))]
    assert links_of(12.0, [HopReport("tail", 9.0, 5)]) == [(("head", "tail"), pytest.approx(3.0))]


def test_a_hop_that_does_not_say_what_it_waited_leaves_the_rest_as_one_link():
    hops = [HopReport("middle", 10.0, 5), HopReport("tail", 9.0, 5)]
    assert links_of(30.0, hops) == [(("head", "tail"), pytest.approx(11.0))]


def test_clocks_that_disagree_never_give_a_negative_link():
    assert links_of(5.0, [HopReport("tail", 9.0, 5)]) == [(("head", "tail"), 0.0)]


def test_lap_times_add_up_to_the_laps():
    times = LapTimes()
    for _ in range(3):
        times.record(positions=1, tokens=1, lap_ms=40.0, head_ms=10.0, head_cache=7,
                     hops=[HopReport("middle", 10.0, 5, 14.0), HopReport("tail", 9.0, 5)])
    view = times.view()
    parts = view["head_ms"] + sum(hop["ms"] for hop in view["hops"]) + sum(link["ms"] for link in view["links"])
    assert parts == pytest.approx(120.0) and view["network_ms"] == pytest.approx(33.0)
    assert view["links"] == [{"from": "head", "to": "middle", "ms": 18.0}, {"from": "middle", "to": "tail", "ms": 15.0}]
    assert times.view(lambda name: name[:1])["links"][1] == {"from": "m", "to": "t", "ms": 15.0}


def test_recent_laps_keep_the_last_figures_and_a_bounded_number_of_them():
    recent = RecentLaps(limit=2)
    times = LapTimes()
    times.record(positions=1, tokens=1, lap_ms=20.0, head_ms=5.0, head_cache=3,
                 hops=[HopReport("tail-a", 10.0, 3, load=4)])
    times.record(positions=1, tokens=1, lap_ms=24.0, head_ms=5.0, head_cache=4,
                 hops=[HopReport("tail-a", 10.0, 4, load=2, busy=0.625)])
    recent.note(times)
    view = recent.view()
    assert [(link["from"], link["to"], link["lap_ms"]) for link in view["links"]] == [("head", "tail-a", 7.0)]
    assert [(hop["node"], hop["sessions"], hop["busy"]) for hop in view["loads"]] == [("tail-a", 2, 0.625)]
    for name in ("tail-b", "tail-c"):
        other = LapTimes()
        other.record(positions=1, tokens=1, lap_ms=20.0, head_ms=5.0, head_cache=3, hops=[HopReport(name, 10.0, 3)])
        recent.note(other)
    assert [link["to"] for link in recent.view()["links"]] == ["tail-b", "tail-c"]  # the oldest went first


def test_a_busy_share_is_of_the_window_or_of_the_time_the_kept_jobs_cover():
    now = 100.0
    jobs = [(88.0, 89.0, 1), (91.0, 93.0, 1), (99.0, 101.0, 1)]  # one before the window; one still running at `now`
    assert busy_share(jobs, now, keeps=128) == pytest.approx(0.3)  # 2 s + 1 s of the last 10
    full = [(95.0 + 0.5 * n, 95.0 + 0.5 * n + 0.25, 1) for n in range(4)]  # the last 4 jobs kept: half busy from 95
    assert busy_share(full, now, keeps=4) == pytest.approx(0.2)  # 1 s of the 5 s since the oldest kept
    assert busy_share([], now, keeps=4) == 0.0
    assert busy_share([(80.0, 100.0, 1)], now, keeps=4) == 1.0
