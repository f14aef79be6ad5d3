"""The warm pool's rules, on a fake clock: longest shared prefix wins, one adopter at a time, TTL and bound."""

from meshws.head.conversation import Conversation, WarmPool, common_prefix


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _warm(held):
    return Conversation(path=object(), held=list(held))


async def test_adopt_takes_the_longest_shared_prefix_once():
    ended = []

    async def end(conversation):
        ended.append(conversation)

    pool = WarmPool(3, 60.0, end, min_tokens=4, clock=Clock())
    short, long = _warm(range(10)), _warm([*range(20), 99])
    await pool.put(short)
    await pool.put(long)
    prompt = list(range(30))
    assert pool.adopt(prompt) is long  # 20 shared against 10
    assert pool.adopt(prompt) is short  # the long one is taken: one request at a time
    assert pool.adopt(prompt) is None and not ended
    await pool.put(_warm([7, 7, 7, 7, 7]))
    assert pool.adopt([1, 2, 3, 4, 5, 6]) is None, "no shared prefix"
    assert pool.adopt([7, 7, 7, 1]) is None, "3 shared tokens are below the minimum of 4"


async def test_a_warm_session_serves_its_owner_only_and_not_once_expired():
    ended, clock = [], Clock()

    async def end(conversation):
        ended.append(conversation)

    pool = WarmPool(4, 30.0, end, min_tokens=4, clock=clock)
    alice = Conversation(path=object(), held=list(range(40)), owner="10.0.0.1\nalice")
    await pool.put(alice)
    prompt = list(range(50))
    assert pool.adopt(prompt, "10.0.0.2\nalice") is None, "another address: its cached length would leak the prompt"
    assert pool.adopt(prompt, "10.0.0.1\nbob") is None, "another user at the same address"
    clock.now += 31
    assert pool.adopt(prompt, "10.0.0.1\nalice") is None, "expired, even before the sweep ran"
    await pool.sweep()
    await pool.sweep()  # a second sweep (or one running meanwhile) finds nothing left to evict
    assert ended == [alice] and pool.evictions["ttl"] == 1


async def test_concurrent_sweeps_never_evict_twice():
    import asyncio

    ended, clock = [], Clock()

    async def end(conversation):
        await asyncio.sleep(0.01)  # a release takes a moment: another sweep runs meanwhile
        ended.append(conversation)

    pool = WarmPool(4, 30.0, end, clock=clock)
    for index in range(3):
        await pool.put(_warm([index] * 20))
    clock.now += 31
    await asyncio.gather(pool.sweep(), pool.sweep(), pool.put(Conversation()))
    assert len(ended) == 3 and len(set(map(id, ended))) == 3 and len(pool) == 0


def test_a_renewed_conversation_has_a_new_session():
    conversation = _warm([1] * 20)
    conversation.steps, old = 7, conversation.sid
    conversation.renew()
    assert conversation.sid != old and conversation.steps == 0 and not conversation.warm and not conversation.held


async def test_a_prompt_equal_to_the_cache_keeps_all_but_its_last_token():
    conversation = _warm(range(10))
    assert conversation.reusable(list(range(10))) == 9
    assert conversation.reusable(list(range(12))) == 10
    assert Conversation(held=list(range(10))).reusable(list(range(12))) == 0, "not warm: nothing to reuse"
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


async def test_ttl_and_bound_end_sessions_and_count_why():
    ended, clock = [], Clock()

    async def end(conversation):
        ended.append(conversation)

    pool = WarmPool(2, 30.0, end, clock=clock)
    first, second, third = _warm([1] * 20), _warm([2] * 20), _warm([3] * 20)
    for conversation in (first, second, third):
        await pool.put(conversation)
        clock.now += 1
    assert ended == [first] and len(pool) == 2 and pool.evictions["lru"] == 1
    await pool.put(Conversation())  # an answer whose session ended (failed): nothing to keep
    assert len(pool) == 2
    clock.now += 28.5
    await pool.sweep()
    assert ended == [first, second] and pool.evictions["ttl"] == 1
    await pool.clear()
    assert ended == [first, second, third] and len(pool) == 0 and pool.evictions["shutdown"] == 1


async def test_a_pool_of_size_zero_keeps_nothing():
    ended = []

    async def end(conversation):
        ended.append(conversation)

    pool = WarmPool(0, 30.0, end)
    conversation = _warm([1] * 20)
    await pool.put(conversation)
    assert len(pool) == 0 and ended == [conversation] and pool.evictions["lru"] == 1
