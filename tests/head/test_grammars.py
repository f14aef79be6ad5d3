"""Grammars for requests compile off the event loop, a few at a time, within a budget; the large are refused unread."""

import asyncio
import threading
import time

import pytest

from meshws.head import grammars
from meshws.head.grammars import MAX_SCHEMA_NODES, GrammarCompiler, schema_nodes
from meshws.model.text.constraints import GrammarError


async def test_a_schema_compiles_on_a_thread_and_is_kept():
    compiler = GrammarCompiler()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammar = await compiler.compile(schema)
    assert "integer" in grammar or len(grammar) > 10
    assert await compiler.compile({"properties": {"a": {"type": "integer"}}, "type": "object"}) == grammar
    assert compiler.describe() == {"compiled": 1, "reused": 1, "refused": 0}


async def test_a_schema_with_too_many_parts_is_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(grammars, "json_grammar", lambda schema: pytest.fail("compiled"))
    huge = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(700)]}
    assert schema_nodes(huge) > MAX_SCHEMA_NODES
    began = time.monotonic()
    with pytest.raises(GrammarError, match="subschemas and properties"):
        await GrammarCompiler().compile(huge)
    assert time.monotonic() - began < 0.5


async def test_slow_compiles_are_bounded_refused_past_the_budget_and_the_loop_goes_on(monkeypatch):
    running, most = [0], [0]
    lock = threading.Lock()

    def slow(schema):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.6)
        with lock:
            running[0] -= 1
        return "grammar"

    monkeypatch.setattr(grammars, "json_grammar", slow)
    compiler = GrammarCompiler(most=2, budget=0.3)
    ticks = []

    async def ticker():
        while True:
            began = time.monotonic()
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic() - began)

    beat = asyncio.create_task(ticker())
    outcomes = await asyncio.gather(*(compiler.compile({"type": "object", "title": str(n)}) for n in range(6)),
                                    return_exceptions=True)
    beat.cancel()
    assert all(isinstance(outcome, GrammarError) and "over 0.3 s" in str(outcome) for outcome in outcomes)
    assert most[0] <= 2  # never more than two compiles at once, the overrunning ones included
    assert max(ticks) < 0.2  # the event loop was never held
    await asyncio.sleep(0.7)  # the overrunning compiles end and give their places back
    monkeypatch.setattr(grammars, "json_grammar", lambda schema: "quick")
    assert await compiler.compile({"type": "object", "title": "after"}) == "quick"
