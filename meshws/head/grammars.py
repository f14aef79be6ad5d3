"""Structured output's grammars compiled for requests: off the event loop, a few at a time, within a time budget.

A JSON schema can take a while to compile (llguidance: an `anyOf` of 700 objects, 0.3 s; 1,000 optional
properties, 0.4 s before it is refused as too big), and any client may send one with every request. So a head
compiles only for admitted requests (each holds a generation slot), at most `MAX_COMPILING` at once on threads of
their own (llguidance leaves the GIL while it works, so the event loop goes on), and a schema not compiled within
`BUDGET_SECONDS` (waiting for a place included) is refused; a compile that runs over keeps its place until it
ends, so a flood of costly schemas never runs more than `MAX_COMPILING` compiles. A schema with more than
`MAX_SCHEMA_NODES` subschemas and properties is refused before any compiling. Compiled grammars are kept by
schema (`MAX_KEPT`): agents send the same tools and formats with every call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict
from typing import Any

import orjson

from ..model.text.constraints import GrammarError, json_grammar

MAX_COMPILING = 2  # compiles at once (each a thread)
BUDGET_SECONDS = 2.0  # for a schema to be compiled, from the request's wait for a place to the grammar
MAX_SCHEMA_NODES = 1024  # subschemas and properties in one schema (OpenAI's strict mode allows 5,000 properties)
MAX_KEPT = 64  # compiled grammars kept, by schema


class GrammarCompiler:
    def __init__(self, most: int = MAX_COMPILING, budget: float = BUDGET_SECONDS) -> None:
        self.budget = budget
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=most, thread_name_prefix="meshws-grammar")
        self._places: asyncio.Semaphore | None = None
        self._most = most
        self._kept: OrderedDict[bytes, str] = OrderedDict()
        self.compiled = self.refused = self.reused = 0

    async def compile(self, schema: dict[str, Any] | None) -> str:
        """The grammar of `schema` (None: any JSON object); GrammarError when it is too large, takes too long or
        cannot be one."""
        key = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            self.reused += 1
            return kept
        nodes = schema_nodes(schema)
        if nodes > MAX_SCHEMA_NODES:
            self.refused += 1
            raise GrammarError(f"the schema has {nodes} subschemas and properties; at most {MAX_SCHEMA_NODES}")
        if self._places is None:
            self._places = asyncio.Semaphore(self._most)
        places = self._places
        try:
            async with asyncio.timeout(self.budget):
                await places.acquire()
                job = asyncio.get_running_loop().run_in_executor(self._pool, json_grammar, schema)
                job.add_done_callback(lambda _: places.release())  # (a compile that runs over keeps its place)
                grammar = await asyncio.shield(job)
        except TimeoutError:
            self.refused += 1
            raise GrammarError(f"the schema takes over {self.budget:g} s to compile here; send a simpler one") from None
        self.compiled += 1
        self._kept[key] = grammar
        while len(self._kept) > MAX_KEPT:
            self._kept.popitem(last=False)
        return grammar

    def describe(self) -> dict[str, int]:
        return {"compiled": self.compiled, "reused": self.reused, "refused": self.refused}


def schema_nodes(schema: Any) -> int:
    """Subschemas and properties in `schema`: every object and array in it (a bound on what compiling costs)."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            count += 1
            stack.extend(node.values())
        elif isinstance(node, list):
            count += 1
            stack.extend(node)
    return count
