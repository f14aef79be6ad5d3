"""A node's measured speed (`model.speed.SpeedMeter`): a few lone steps at a busy run's edge do not move it, a machine
that really slows down does within its window, and a probe (the mean of many steps) counts as a window's worth."""

from meshws.model.speed import STEADY_STEPS, WINDOW_SECONDS, SpeedMeter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def steps(meter: SpeedMeter, clock: Clock, seconds: float, count: int, every: float = 0.01) -> None:
    for _ in range(count):
        clock.now += every
        meter.record(seconds * 10, 10)


def test_a_few_slow_steps_after_a_quiet_spell_are_weighed_with_those_before():
    clock = Clock()
    meter = SpeedMeter(clock=clock)
    steps(meter, clock, 0.002, 100)  # one session decoding alone
    clock.now += 30  # batched: no lone step timed
    steps(meter, clock, 0.004, 6)  # the next run's first steps, beside other sessions' prompts
    assert meter.layer_seconds == 0.002
    steps(meter, clock, 0.004, STEADY_STEPS)  # a machine that stays slow
    assert meter.layer_seconds == 0.004


def test_many_steps_within_the_window_show_a_slow_down_at_once():
    clock = Clock()
    meter = SpeedMeter(clock=clock)
    steps(meter, clock, 0.002, 200)
    clock.now += WINDOW_SECONDS  # the fast steps fall out of the window
    steps(meter, clock, 0.003, STEADY_STEPS + 1, every=0.05)
    assert meter.layer_seconds == 0.003 and meter.describe()["samples"] == STEADY_STEPS + 1


def test_a_probe_counts_as_a_window_of_steps():
    clock = Clock()
    meter = SpeedMeter(clock=clock)
    assert meter.layer_seconds is None
    steps(meter, clock, 0.002, 100)
    clock.now += 20
    meter.record(0.005 * 10, 10, "probe", STEADY_STEPS)
    assert meter.layer_seconds == 0.005 and meter.source == "probe"


def test_two_probes_in_the_window_give_their_mean_so_a_slow_down_shows_at_the_second():
    clock = Clock()
    meter = SpeedMeter(clock=clock)
    meter.record(0.002 * 10, 10, "probe", STEADY_STEPS)
    clock.now += 3  # a spare's probes, PROBE_EVERY apart
    meter.record(0.004 * 10, 10, "probe", STEADY_STEPS)
    assert meter.layer_seconds == 0.003  # not the faster of the two


def test_a_nodes_probe_weighs_as_a_window_and_its_steps_as_one_each():
    from types import SimpleNamespace

    from meshws.placement import NodeCapacity

    costs = SimpleNamespace(units=lambda start, end: float(end - start))
    shard = SimpleNamespace(costs=costs, start=0, end=10, is_tail=True)
    capacity = NodeCapacity(SimpleNamespace(shard=shard, settings=SimpleNamespace(memory=1 << 30)))
    clock = Clock()
    capacity.meter = SpeedMeter(clock=clock)
    for _ in range(100):
        capacity.step_timed(0.02 + 0.001, lm_head=0.001)  # 2 ms per layer, steps
    clock.now += 30
    capacity.step_timed(0.04 + 0.003, lm_head=0.003, source="probe")  # slower now: one probe decides
    assert capacity.meter.layer_seconds == 0.004
    capacity.step_timed(0.08, source="steps")  # one slow lone step beside it moves nothing
    assert capacity.meter.layer_seconds == 0.004
