"""The shared prefix pool's rules with a fake build: exact tokens only, the longest wins, one build for concurrent
requests, a salt apart, bounded, and a prefix lost on a shard goes."""

import asyncio

from meshws.head.conversation import Conversation
from meshws.head.prefixes import PREFIX_BLOCK as B, PrefixPool


class Builds:
    def __init__(self, fail=False):
        self.made, self.ended, self.fail = [], [], fail
        self.gate = asyncio.Event()
        self.gate.set()

    async def build(self, tokens, fork):
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("no route")
        session = Conversation(path=object(), held=list(tokens))
        self.made.append((len(tokens), fork))
        return session

    async def end(self, session):
        session.path = None
        self.ended.append(session)


def _prompt(length, seed=0):
    return [(seed * 7919 + i * 31) % 5000 + 1 for i in range(length)]


async def test_the_first_request_builds_its_prefix_and_the_next_forks_it():
    builds = Builds()
    pool = PrefixPool(4, builds.build, builds.end)
    prompt = _prompt(2 * B + 10)
    fork, computed = await pool.fork_for(prompt, "")
    assert fork.length == 2 * B and computed == 2 * B and builds.made == [(2 * B, None)]
    again, computed = await pool.fork_for(prompt[: 2 * B + 1] + [9, 9, 9], "")  # another question after it
    assert again == fork and computed == 0 and pool.hits == 1 and len(builds.made) == 1
    assert await pool.fork_for(prompt[:B], "") is None, "less than a whole block shared (its last token runs)"
    assert await pool.fork_for(_prompt(B, seed=5), "") is None, "nothing shared, and too short to keep"
    assert len(builds.made) == 1


async def test_tokens_must_match_exactly_and_a_longer_prompt_extends_the_longest_prefix():
    builds = Builds()
    pool = PrefixPool(8, builds.build, builds.end)
    prompt = _prompt(3 * B + 5)
    first, _ = await pool.fork_for(prompt[: B + 3], "")
    near = list(prompt)
    near[B - 1] += 1  # the last token of the first block differs: no whole block is shared, never a token alone
    other, computed = await pool.fork_for(near, "")
    assert other.sid != first.sid and other.length == 3 * B and computed == 3 * B
    assert builds.made[-1] == (3 * B, None)
    longer, computed = await pool.fork_for(prompt, "")  # the first block is kept: only the rest is computed
    assert computed == 2 * B and builds.made[-1] == (3 * B, first) and longer.length == 3 * B
    question, computed = await pool.fork_for(near[: 3 * B + 1] + [1, 2, 3], "")  # within `near`'s blocks
    assert question == other and computed == 0
    one_more, computed = await pool.fork_for(prompt[: 3 * B + 40] + [5] * 40, "")  # a block beyond: not worth one
    assert one_more == longer and computed == 0 and len(builds.made) == 3


async def test_concurrent_requests_wait_for_one_build_and_a_salt_keeps_prefixes_apart():
    builds = Builds()
    builds.gate.clear()
    pool = PrefixPool(4, builds.build, builds.end)
    prompt = _prompt(B + 8)
    waiting = [asyncio.create_task(pool.fork_for(prompt, "")) for _ in range(3)]
    await asyncio.sleep(0.01)
    builds.gate.set()
    results = await asyncio.gather(*waiting)
    assert len(builds.made) == 1 and len({fork for fork, _ in results}) == 1
    assert sorted(computed for _, computed in results) == [0, 0, B], "only the request that built it computed it"
    salted, computed = await pool.fork_for(prompt, "tenant-b")
    assert salted != results[0][0] and computed == B and len(builds.made) == 2


async def test_the_bound_ends_the_least_recently_used_and_a_lost_prefix_goes():
    builds = Builds()
    pool = PrefixPool(2, builds.build, builds.end)
    forks = [(await pool.fork_for(_prompt(B + 1, seed), ""))[0] for seed in range(3)]
    await pool.sweep()  # (the head sweeps now and then, and before each request)
    assert len(pool) == 2 and len(builds.ended) == 1 and builds.ended[0].sid == forks[0].sid
    await pool.spoiled(forks[2])
    assert len(pool) == 1 and builds.ended[-1].sid == forks[2].sid
    await pool.clear()
    assert len(pool) == 0 and len(builds.ended) == 3 and pool.evictions == 3


async def test_a_failed_build_leaves_nothing_and_the_request_prefills_in_full():
    builds = Builds(fail=True)
    pool = PrefixPool(2, builds.build, builds.end)
    assert await pool.fork_for(_prompt(B + 1), "") is None
    assert len(pool) == 0 and pool._entries == []


async def test_a_build_ends_with_its_last_waiter_and_goes_on_while_one_waits():
    builds = Builds()
    builds.gate.clear()
    pool = PrefixPool(4, builds.build, builds.end)
    prompt = _prompt(2 * B + 8)
    first = asyncio.create_task(pool.fork_for(prompt, ""))
    second = asyncio.create_task(pool.fork_for(prompt, ""))
    await asyncio.sleep(0.01)
    first.cancel()  # one client hangs up: the other still waits, the build goes on
    await asyncio.sleep(0.01)
    builds.gate.set()
    fork, computed = await second
    assert fork.length == 2 * B and len(builds.made) == 1 and len(pool) == 1
    builds.gate.clear()
    alone = asyncio.create_task(pool.fork_for(_prompt(2 * B + 8, seed=3), ""))
    await asyncio.sleep(0.01)
    alone.cancel()  # the only one: its build is cancelled, and nothing of it is kept
    await asyncio.sleep(0.01)
    assert not pool._builds and len(pool._entries) == 1 and len(builds.made) == 1
    builds.gate.set()
    again, computed = await pool.fork_for(_prompt(2 * B + 8, seed=3), "")
    assert computed == 2 * B and len(builds.made) == 2


async def test_the_request_that_starts_a_build_waits_it_out_and_clear_cancels_builds(monkeypatch):
    from meshws.head import prefixes

    monkeypatch.setattr(prefixes, "BUILD_WAIT", 0.05)  # (others wait this long for a build, then prefill in full)
    builds = Builds()
    builds.gate.clear()
    pool = PrefixPool(4, builds.build, builds.end)
    prompt = _prompt(2 * B + 8)
    starter = asyncio.create_task(pool.fork_for(prompt, ""))
    await asyncio.sleep(0.01)
    assert await pool.fork_for(prompt, "") is None, "another request gives up after BUILD_WAIT"
    await asyncio.sleep(0.1)
    builds.gate.set()  # a prefill longer than BUILD_WAIT: its own request still forks it
    fork, computed = await starter
    assert fork.length == 2 * B and computed == 2 * B and len(pool) == 1
    builds.gate.clear()
    pending = asyncio.create_task(pool.fork_for(_prompt(2 * B + 8, seed=4), ""))
    await asyncio.sleep(0.01)
    await pool.clear()  # the node stops: the build is cancelled before the kept prefixes are ended
    assert not pool._builds and pool._entries == [] and len(builds.ended) == 1
    assert await pending is None
