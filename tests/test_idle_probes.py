"""An idle node's speed probes (`placement.IdleProbes`): ever rarer while they find the same speed, soon again once it
changes or the node runs steps, so that an idle machine does not spend a share of its cores measuring itself."""

from meshws.model.speed import STEADY_STEPS, SpeedMeter
from meshws.placement import PROBE_EVERY, PROBE_MOST, IdleProbes, idle_seconds


class IdleNode:
    """`NodeCapacity._probe_forever`'s loop on a clock of its own: a tick each PROBE_EVERY / 2 seconds."""

    def __init__(self, seconds_per_layer: float, steady: bool = True) -> None:
        self.now = 0.0
        self.steady = steady  # settled in the plan (else: just started, or a spare)
        self.meter = SpeedMeter(clock=lambda: self.now)
        self.probes = IdleProbes()
        self.speed = seconds_per_layer
        self.probed_at = [0.0]
        self.meter.record(self.speed * 10, 10, "probe", STEADY_STEPS)  # the probe at start

    def run(self, seconds: float) -> list[float]:
        """The gaps between the probes made in the next `seconds`."""
        first = len(self.probed_at)
        until = self.now + seconds
        while self.now < until:
            self.now += PROBE_EVERY / 2
            if self.probes.due(self.meter.idle_for(), self.meter.source, self.steady):
                before = self.meter.layer_seconds
                self.meter.record(self.speed * 10, 10, "probe", STEADY_STEPS)
                self.probed_at.append(self.now)
                self.probes.probed(before, self.meter.layer_seconds)
        times = self.probed_at[max(0, first - 1):]
        return [round(later - earlier, 3) for earlier, later in zip(times, times[1:])]


def test_probes_of_a_steady_idle_node_grow_apart_up_to_the_most():
    node = IdleNode(0.002)
    gaps = node.run(400)
    assert gaps[:6] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, PROBE_MOST, PROBE_MOST], gaps
    assert max(gaps) == PROBE_MOST and len(node.probed_at) <= 12  # 400 s idle: a dozen probes, not 133


def test_a_changed_speed_or_a_step_brings_the_probes_back_to_the_shortest_wait():
    node = IdleNode(0.002)
    node.run(200)  # long since at the most
    node.speed = 0.004  # the machine slowed down (a build beside it, a throttled laptop)
    gaps = node.run(PROBE_MOST + 3 * PROBE_EVERY)
    assert gaps[0] <= PROBE_MOST and gaps[1] == PROBE_EVERY, gaps  # the probe that saw it, and the next one soon
    node.run(200)
    stepped = node.now
    node.meter.record(0.004 * 10, 10, "steps")  # a lone decode step of a user's session
    node.run(PROBE_EVERY)
    assert node.probed_at[-1] == stepped + PROBE_EVERY  # idle again: measured as soon as after the first idle spell


def test_a_node_not_yet_settled_or_left_out_of_the_plan_probes_at_the_shortest_wait():
    node = IdleNode(0.002, steady=False)  # its first PROBE_SETTLE seconds, or a spare weighed for a place
    assert set(node.run(60)) == {PROBE_EVERY}
    node.steady = True  # settled in the plan: its probes grow apart
    assert node.run(100)[:3] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]
    node.steady = False  # the plan left it out: weighed often again
    assert node.run(4 * PROBE_MOST)[-3:] == [PROBE_EVERY] * 3


def test_a_node_busy_with_batches_is_not_idle_though_it_timed_no_lone_step():
    node = IdleNode(0.002)
    node.now = 30.0  # no lone step timed for 30 s ...
    assert idle_seconds(node.meter, [], now=node.now) == 30.0
    batches = [(28.0, 29.0, 16), (29.0, 29.5, 16)]  # ... but its worker ran batches of 16 until half a second ago
    assert idle_seconds(node.meter, batches, now=node.now) == 0.5
    node.now = 40.0  # the load ended 10.5 s ago: idle again, probed as before
    assert idle_seconds(node.meter, batches, now=node.now) == 10.5
