"""A generation's way through the mesh: its route, and the session channel on the link to its first hop.

`HopChannel` is the head's end of one session channel: open (with the route the
hops may dial, signed), tensor steps answered by tokens, close. `RoutedPath`
holds a generation's current route and channel and replaces both when a hop
fails, avoiding the hop that failed (the one a timeout blames, when it can tell).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..mesh.auth import sign_route
from ..mesh.next_hops import signed_parts
from ..mesh.link import Link, LinkDown
from ..mesh.wire import CacheMiss, Close, Error, Open, RouteHop, SessionReply, Token
from ..model.backend import TailTokenResult, TensorPayload
from ..model.kv.cache_store import KVCacheMiss
from ..model.text.sampling_params import SamplingParams
from .planner import RoutePlanner
from .routes import NoRoute, Route
from .stats import GenerationStats

LINK_WAIT = 5.0  # seconds to wait for a link that is still being dialed
MAX_FAILOVERS = 3  # re-routes per generation before its error is reported
log = logging.getLogger("meshws.generation")


class PipelineError(Exception):
    """The mesh could not produce the next token; the message names the cause."""

    def __init__(self, message: str, lost: bool = False, url: str | None = None) -> None:
        super().__init__(message)
        self.lost = lost  # a hop went away or hung: another route might work
        self.url = url  # the hop that went away, when known


class RouteCacheMiss(KVCacheMiss):
    """A hop of the route answered `cache_miss` (not the head's own cache)."""


class HopChannel:
    """The head's end of one session channel on the link to its first hop."""

    def __init__(self, link: Link, sid: str, step_timeout: float, compress_min_bytes: int,
                 secret: str | None = None) -> None:
        self.link = link
        self.secret = secret  # signs the route, so the hops dial only what this head chose
        self.sid = sid
        self.step_timeout = step_timeout
        self.compress_min_bytes = compress_min_bytes
        self.hung_url: str | None = link.url  # the hop a timeout blames: ours alone while nothing lies behind it
        self._replies: asyncio.Queue[SessionReply] = asyncio.Queue()
        link.subscribe(sid, self._replies.put_nowait)

    async def open(self, sampling: SamplingParams, prompt_tokens: int, route: tuple[RouteHop, ...],
                   resume: bool = False, fork: tuple[str, int] | None = None,
                   layers: tuple[int, int] | None = None, kept: bool = False, standby: str | None = None) -> None:
        parts = signed_parts(route, standby)
        mac = sign_route(self.secret, self.sid, parts) if self.secret and parts else None
        message = Open(sid=self.sid, sampling=sampling, prompt_tokens=prompt_tokens, route=route, route_mac=mac,
                       resume=resume, fork=fork, layers=layers, kept=kept, standby=standby)
        self.hung_url = None if route else self.link.url  # behind a dialed route, any of its hops may hang
        if not self.link.is_up:
            await self.link.wait_up(LINK_WAIT)
        try:
            await self.link.send_control(message)
        except LinkDown as exc:
            raise PipelineError(str(exc), lost=True, url=self.link.url) from exc

    async def step(self, step: int, mode: str, payload: TensorPayload, ids: list[int] | None,
                   drafts: tuple[int, ...] = ()) -> TailTokenResult:
        try:  # (a plain decode row goes with its wave's other rows, in one frame)
            await self.link.send_step(self.sid, step, mode, payload, ids, drafts, self.compress_min_bytes)
        except LinkDown as exc:
            raise PipelineError(str(exc), lost=True, url=self.link.url) from exc
        deadline = time.monotonic() + self.step_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:  # asyncio.timeout, not wait_for: wait_for (3.11) loses a cancellation that meets a reply
                async with asyncio.timeout(max(remaining, 0.001)):
                    reply = await self._replies.get()
            except TimeoutError:
                raise PipelineError(f"no answer from the route behind {self.link.url} within "
                                    f"{self.step_timeout:.0f} s", lost=True, url=self.hung_url) from None
            if getattr(reply, "step", None) not in (None, step):
                continue  # a late answer to an earlier step
            if isinstance(reply, Token):
                return TailTokenResult(text=reply.text or "", token_id=reply.token_id, token_ids=reply.token_ids,
                                       hops=reply.hops, logprobs=reply.logprobs,
                                       prompt_logprobs=reply.prompt_logprobs)
            if isinstance(reply, CacheMiss):
                raise RouteCacheMiss(reply.reason)
            if isinstance(reply, Error):
                raise PipelineError(reply.message, lost=reply.lost, url=reply.url)

    async def close(self, grace: bool = False) -> None:
        """The session ends on the route (`grace`: it goes on elsewhere, so the hops' standbys wait a moment)."""
        self.link.unsubscribe(self.sid)
        try:
            await self.link.send_control(Close(sid=self.sid, grace=grace))
        except LinkDown:
            pass  # the next hop releases the session when the link drops



class RoutedPath:
    """A generation's current route and its channel, replaced when a hop fails."""

    def __init__(self, planner: RoutePlanner, sid: str, route: Route | None, step_timeout: float,
                 compress_min_bytes: int, secret: str | None) -> None:
        self.planner = planner
        self.sid = sid
        self.step_timeout = step_timeout
        self.compress_min_bytes = compress_min_bytes
        self.secret = secret
        self.planned = route  # planned at admission: the first open takes it
        self.route: Route | None = None
        self.channel: HopChannel | None = None
        self.avoid: set[str] = set()
        self.kept = False  # a shared prompt prefix's session (`prefixes`): every shard counts it apart
        self.standby_held: list[int] = []  # each hop's standby's positions, as the hops last reported them

    @property
    def view(self) -> list[dict]:
        """The current route as /health and the chat page show it."""
        return self.route.view if self.route is not None else []

    async def open(self, sampling: SamplingParams, prompt_tokens: int, fork: tuple[str, int] | None = None,
                   resume: bool = False) -> None:
        planner = self.planner
        route, self.planned = self.planned, None  # admitted and held already
        try:
            self.route = route or planner.hold(await planner.plan_settled(self.sid, self.avoid))
        except NoRoute as exc:
            raise PipelineError(str(exc)) from exc
        if self.route.link is not None:
            self.channel = HopChannel(self.route.link, self.sid, self.step_timeout, self.compress_min_bytes,
                                      self.secret)
            standby = None if self.kept else self.route.first_standby  # (later hops' are in the route's hops)
            await self.channel.open(sampling, prompt_tokens, self.route.hops, fork=fork, layers=self.route.layers,
                                    kept=self.kept, standby=standby, resume=resume)
        self.standby_held = []

    async def resume(self, sampling: SamplingParams, prompt_tokens: int) -> None:
        """A conversation's next answer on the same route: every hop keeps its cache and takes the new sampling."""
        if self.channel is not None and self.route is not None:
            await self.channel.open(sampling, prompt_tokens, self.route.hops, resume=True, layers=self.route.layers,
                                    standby=None if self.kept else self.route.first_standby)

    async def step(self, step: int, mode: str, payload: TensorPayload, ids: list[int] | None,
                   drafts: tuple[int, ...] = ()) -> TailTokenResult:
        if self.channel is None:
            raise PipelineError("the head has no next hop for its hidden states")
        result = await self.channel.step(step, mode, payload, ids, drafts)
        if result.hops:  # (in route order, one a hop)
            self.standby_held = [report.standby or 0 for report in result.hops]
        return result

    async def reroute(self, failure: PipelineError, sampling: SamplingParams, prompt_tokens: int) -> None:
        """Close the session on the failed route and open it again on one without the failed hop.

        Hops that failed earlier in this generation are avoided too, unless no route is left
        without them: a node restarted at its old address is a good hop again.
        """
        failed = {failure.url} if failure.url else set(self.route.urls if self.route else ())
        earlier, self.avoid = self.avoid, self.avoid | failed
        await self.close()
        try:
            await self.open(sampling, prompt_tokens)
        except PipelineError as exc:
            if not earlier - failed:
                raise PipelineError(f"{failure}; and no other route: {exc}", exc.lost, exc.url) from exc
            self.avoid = failed
            await self.close()
            try:
                await self.open(sampling, prompt_tokens)
            except PipelineError as again:
                raise PipelineError(f"{failure}; and no other route: {again}", again.lost, again.url) from again

    async def resume_on_standby(self, failure: PipelineError, sampling: SamplingParams, prompt_tokens: int) -> int:
        """When `failure` is the loss of a hop whose standby holds the session: the session goes on there (its copy
        adopted, `open` with resume; the hops after it hold theirs: `Open.hold`). The positions the standby holds,
        or 0 (nothing done)."""
        route = self.route
        if route is None or failure.url not in route.urls:
            return 0
        index = route.urls.index(failure.url)
        held = self.standby_held[index] if index < len(self.standby_held) else 0
        standby = self.planner.standby_route(route, index) if held else None
        if standby is None:
            return 0
        self.avoid |= {failure.url}
        old = self.channel if index == 0 else None  # (else the hops before keep the session: the open re-links them)
        route.release()
        self.route, self.planned = None, standby
        await self.open(sampling, prompt_tokens, resume=True)
        if old is not None:  # (after: a hop that went but lives lets its standby's copy go only after a while)
            await old.close(grace=True)
        return held

    async def after_loss(self, failure: PipelineError, sampling: SamplingParams, prompt_tokens: int,
                         stats: GenerationStats) -> int:
        """The route's first hop went while a conversation was idle: its standby's copy if the tail had one (the
        positions it holds), else a new route (0: everything is prefilled again)."""
        try:
            held = await self.resume_on_standby(failure, sampling, prompt_tokens)
        except PipelineError:
            held = 0  # (the standby went too)
        if not held:
            await self.close()
            await self.open(sampling, prompt_tokens)
        stats.failovers, stats.standby_resumes = stats.failovers + 1, stats.standby_resumes + bool(held)
        return held

    async def after_miss(self, miss: Exception, sampling: SamplingParams, prompt_tokens: int,
                         stats: GenerationStats) -> int:
        """A hop of the route lacked the session's cache (its tail restarted, or let the session go): where the
        tail had a standby, the session goes on from its copy; the positions it holds, or 0 (prefilled again as it
        is). A miss in the head's own cache changes nothing."""
        tail_held = self.standby_held[-1] if self.standby_held else 0
        if not isinstance(miss, RouteCacheMiss) or self.route is None or not tail_held:
            return 0
        lost = PipelineError("the tail lost the session's cache", lost=True, url=self.route.urls[-1])
        try:
            held = await self.resume_on_standby(lost, sampling, prompt_tokens)
        except PipelineError:  # (the standby went too: a new route, everything again)
            await self.close()
            await self.open(sampling, prompt_tokens)
            held = 0
        stats.failovers, stats.standby_resumes = stats.failovers + bool(held), stats.standby_resumes + bool(held)
        return held

    async def failover(self, failure: PipelineError, sampling: SamplingParams, prompt_tokens: int,
                       stats: GenerationStats, held: int, positions: int) -> int:
        """Route around `failure`; again while the new route's first hop is lost too and failovers remain. Of the
        `positions` so far (`held` in the caches), those the new route's caches keep (a standby's copy), or 0: all
        are prefilled again."""
        while True:
            stats.failovers += 1
            log.warning("session %s: %s; re-routing (failover %d)", stats.sid[:12], failure, stats.failovers)
            try:
                kept = min(held, await self.resume_on_standby(failure, sampling, prompt_tokens))
                if not kept:
                    await self.reroute(failure, sampling, prompt_tokens)
                stats.route = self.view
                stats.standby_resumes += 1 if kept else 0
                stats.recomputed_tokens += positions - kept
                return kept
            except PipelineError as again:
                if not again.lost or stats.failovers >= MAX_FAILOVERS:
                    raise
                failure = again

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        if self.route is not None:
            self.route.release()
        self.route = None
