"""Generate a batch of rollout records from SGLang servers over HTTP `/generate`.

Owns sending a batch: bounded concurrency (one pool of slots for every batch in flight, oldest step first:
``moe_rl.rollout.slots``; its size is ``rollout.max_concurrency``, by default ``rollout.server_concurrency`` per
server: ``moe_rl.sizing.defaults.client_concurrency``), each sample's request and its continuations (a reply
aborted by a pause, or by this client when the request ran past ``rollout.request_timeout_s``, is continued from
its tokens: ``moe_rl.rollout.partial``), retries with backoff on connection errors and 5xx and on requests aborted
from outside the run (an admin's ``/abort_request``, or the abort of an ``/update_weight_version`` or
``/pause_generation``: sent again, counted, one line per batch), and the all-or-nothing rule: a batch either comes
back whole or the call raises RolloutError. What a request asks for (sampling, seeds, the body) is
`moe_rl.rollout.request`; what a reply means (the error classes, its status and body, the sample it decodes to) is
`moe_rl.rollout.replies`; the HTTP session (aiohttp, for its CPU per request) and the bound on one request is
`moe_rl.rollout.http_session`; which server a request goes to (a group's samples to one server, groups balanced
by load: ``rollout.load_balance``) is `moe_rl.rollout.dispatch`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Sequence

import numpy as np

from moe_rl.records import RolloutSample, RouteSpec
from moe_rl.rollout import http_session
from moe_rl.rollout.auth import ServerKeys
from moe_rl.rollout.dispatch import LOAD_BALANCE, Dispatch, Group
from moe_rl.rollout.health import run_watched
from moe_rl.rollout.partial import (
    PartialCounters,
    check_pause_mode,
    continuation_prompt,
    continuation_seed,
    is_pause_abort,
    is_queued_abort,
    kv_stale_tokens,
    stitch,
)
from moe_rl.rollout.replies import (
    OutsideAborts,
    Retryable,
    RolloutError,
    RolloutRequestError,
    read_reply,
    reply_to_sample,
)
from moe_rl.rollout.request import SamplingSettings, generate_body, sample_seed, wire_top_k
from moe_rl.rollout.slots import StepSlots
from moe_rl.sizing.defaults import client_concurrency, request_timeout

logger = logging.getLogger(__name__)
ABORT_GRACE_S = 30.0  # a server that sends no reply this long after aborting a request is hung (health_timeout_s)


__all__ = ["LOAD_BALANCE", "RolloutClient", "SamplingSettings", "sample_seed"]


class RolloutClient:
    """Sends prompts x n samples to `addresses` and returns `RolloutSample`s in request order.

    `route_spec=None` skips routes (no `return_routed_experts`); `return_sampling_mask=False` skips
    masks. Sample `j` of prompt `i` is result `i * n + j`, with `group_id = group_ids[i]`.
    `pause_mode` (``rollout.partial``): the servers may be paused mid-request in that mode; with
    ``abort`` a reply ended by the pause is continued (at most `max_continuations` times) and stitched.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        route_spec: RouteSpec | None,
        vocab_size: int,
        sampling: SamplingSettings = SamplingSettings(),  # noqa: B008 -- a frozen dataclass (request.py)
        *,
        seed: int = 0,
        return_sampling_mask: bool = True,
        sampling_mask_max_tokens: int = 4096,
        request_timeout_s: float = 120.0,
        max_concurrency: int = 16,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        headers: dict[str, str] | None = None,
        admin_headers: dict[str, str] | None = None,
        health_timeout_s: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        pause_mode: str | None = None,
        max_continuations: int = 8,
        load_balance: str = "least_outstanding",
    ):
        if not addresses:
            raise ValueError("addresses is empty; expected at least one http://host:port")
        self.addresses = [a.rstrip("/") for a in addresses]
        self.route_spec = route_spec
        self.vocab_size = vocab_size
        self.sampling = sampling
        self.seed = seed
        self.return_sampling_mask = return_sampling_mask
        self.request_timeout_s = request_timeout_s
        self.max_concurrency = max_concurrency
        self._slots = StepSlots(max_concurrency)  # shared by every batch in flight, oldest step first (slots.py)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.headers = dict(headers or {})  # Authorization when the servers have an API key (auth.py)
        self.admin_headers = dict(admin_headers or {})  # resuming a server paused from outside the run (health.py)
        self.health_timeout_s = health_timeout_s  # a server silent this long aborts the batch (health.py)
        self.stop_token_ids = (
            None if stop_token_ids is None else [int(t) for t in stop_token_ids]
        )  # the tokenizer's EOS
        self.pause_mode = None if pause_mode is None else check_pause_mode(pause_mode)
        self.max_continuations = max_continuations
        self.partial_counters = PartialCounters()  # drained by the trainer: async/kv_stale_tokens, ...
        self.load_balance = load_balance
        self.dispatch = Dispatch(len(self.addresses), load_balance)  # a group's samples to one server (dispatch.py)
        self._replied: dict[str, float] = {}  # address -> monotonic time of its last reply: not probed meanwhile
        self._top_k = wire_top_k(sampling, return_sampling_mask, sampling_mask_max_tokens, vocab_size)

    @classmethod
    def from_config(cls, cfg, addresses: Sequence[str], **overrides) -> RolloutClient:
        """Client for an ExperimentConfig: routes when replay needs them, masks for keep-sampling-mask."""
        r = cfg.rollout
        kwargs = {
            # routes always: even routing=none logs the rollout-vs-learner flip rate from them
            "route_spec": RouteSpec.from_model_config(cfg.model),
            "vocab_size": cfg.model.vocab_size,
            "sampling": SamplingSettings.from_rollout_config(r),
            "seed": r.seed,
            "return_sampling_mask": cfg.ksm_active,  # untruncated sampling: KSM is a no-op (the preflight notes it)
            "sampling_mask_max_tokens": r.sampling_mask_max_tokens,
            "request_timeout_s": request_timeout(cfg).value,  # derived from max_new_tokens when unset
            "max_concurrency": client_concurrency(cfg, len(addresses)).value,  # per server x servers when unset
            "max_retries": r.max_retries,
            "headers": ServerKeys.from_rollout_config(r).headers(),
            "admin_headers": ServerKeys.from_rollout_config(r).headers(admin=True),
            "health_timeout_s": r.health_timeout_s,
            "pause_mode": r.pause_mode if r.partial else None,
            "load_balance": r.load_balance,
        }
        kwargs.update(overrides)
        return cls(addresses, **kwargs)

    def request_body(
        self, prompt_ids: Sequence[int], seed: int | None, routes_start_len: int = 0, max_new_tokens: int | None = None
    ) -> dict:
        """JSON body of one `/generate` request for `prompt_ids[P]` (``moe_rl.rollout.request.generate_body``).

        `routes_start_len > 0` (continued generation) asks only for route rows from that position on;
        `max_new_tokens` overrides the sampling settings' (the rest of an aborted sample's budget).
        """
        return generate_body(
            prompt_ids,
            self.sampling,
            self._top_k,
            seed=seed,
            routes=self.route_spec is not None,
            masks=self.return_sampling_mask,
            stop_token_ids=self.stop_token_ids,
            routes_start_len=routes_start_len,
            max_new_tokens=max_new_tokens,
        )

    def generate(self, prompts: Sequence[Sequence[int]], n: int = 1, **kwargs) -> list[RolloutSample]:
        """Blocking `agenerate` (runs its own event loop).

        The samples leave through a list, not as the main task's result: on exit `asyncio.run` restores the SIGINT
        handler, and CPython's `signal.signal` formats the old handler (a partial holding the main task) with `repr`,
        i.e. the repr of every sample's arrays: 7% of the client's time in `bench/profile_rollout.py` before this.
        """
        samples: list[RolloutSample] = []

        async def main() -> None:
            samples.extend(await self.agenerate(prompts, n, **kwargs))

        asyncio.run(main())
        return samples

    async def agenerate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        *,
        group_ids: Sequence[int] | None = None,
        step: int = 0,
        seeded: bool = True,
        routes_start_len: Sequence[int] | None = None,
        counters: PartialCounters | None = None,
        seeds: Sequence[int] | None = None,
        max_new_tokens: Sequence[int] | None = None,
        groups: Sequence[Group] | None = None,
    ) -> list[RolloutSample]:
        """`len(prompts) * n` samples, or RolloutError; never fewer. `seeded=False` sends no seed. `counters`: where
        this call's ``async/*`` counts go (default: the client's ``partial_counters``).

        `routes_start_len[i]` (multi-turn / continued generation): prompt `i`'s samples carry only the
        route rows `[start, P + R - 1)`, the rows before it being known from the earlier turn.
        `seeds[i]` / `max_new_tokens[i]` (an agent loop's turn, ``n=1``): prompt `i`'s own seed and token budget.
        `groups[i]`: the caller's ``Group`` for prompt `i` (``pending == n``; an agent's turn sets ``prefer``, and
        reads ``home`` back once the call returns).
        """
        if n < 1:
            raise ValueError(f"n={n}; expected >= 1 samples per prompt")
        for name, values in (("seeds", seeds), ("max_new_tokens", max_new_tokens)):
            if values is not None and (n != 1 or len(values) != len(prompts)):
                raise ValueError(f"{name} has {len(values)} entries with n={n}; expected one per prompt and n=1")
        group_ids = list(range(len(prompts))) if group_ids is None else list(group_ids)
        if len(group_ids) != len(prompts):
            raise ValueError(f"group_ids has {len(group_ids)} entries; expected one per prompt ({len(prompts)})")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty; expected at least one token id")
        starts = [0] * len(prompts) if routes_start_len is None else [int(s) for s in routes_start_len]
        if len(starts) != len(prompts) or any(not 0 <= s <= len(p) for s, p in zip(starts, prompts)):
            raise ValueError(f"routes_start_len={starts}; expected one value in [0, len(prompt)] per prompt")
        budgets = [None] * len(prompts) if max_new_tokens is None else [int(b) for b in max_new_tokens]
        seed_of = lambda i, g, j: sample_seed(self.seed, step, g, j) if seeds is None else int(seeds[i])
        if groups is None:
            groups = [Group(len(p) + (b or self.sampling.max_new_tokens), n) for p, b in zip(prompts, budgets)]
        elif len(groups) != len(prompts) or any(g.pending != n or g.home is not None for g in groups):
            raise ValueError(f"groups: expected one unplaced Group per prompt ({len(prompts)}) with pending == n={n}")
        jobs = [
            (np.asarray(p, dtype=np.int32), g, seed_of(i, g, j) if seeded else None, start, budget, groups[i])
            for i, (p, g, start, budget) in enumerate(zip(prompts, group_ids, starts, budgets))
            for j in range(n)
        ]
        gate = self._slots.gate(step)  # the client's max_concurrency, across the batches of every thread
        aborts = OutsideAborts()
        async with http_session.Session(self.max_concurrency, self.request_timeout_s, self.headers) as http:

            async def whole_batch():
                try:
                    async with asyncio.TaskGroup() as tg:  # first failure cancels the rest: no partial batch
                        tasks = [tg.create_task(self._one(http, gate, *job, counters, aborts)) for job in jobs]
                except* RolloutError as group:
                    raise group.exceptions[0] from None
                return [t.result() for t in tasks]

            try:
                return await run_watched(
                    whole_batch(),
                    self.addresses,
                    self.health_timeout_s,
                    self.headers,
                    self._replied,
                    self.admin_headers,
                )
            finally:
                if aborts.count:
                    logger.warning(
                        "rollout: %d request(s) of a batch were aborted by the server, not by this run (an outside "
                        "/abort_request, /update_weight_version or /pause_generation), and sent again (%s)",
                        aborts.count,
                        aborts.first,
                    )

    async def _one(
        self,
        http,
        gate,
        prompt,
        group_id,
        seed,
        start,
        budget: int | None = None,
        group: Group | None = None,
        counters: PartialCounters | None = None,
        aborts: OutsideAborts | None = None,
    ) -> RolloutSample:
        budget, counters = budget or self.sampling.max_new_tokens, counters or self.partial_counters
        group = group or Group(len(prompt) + budget, 1)
        try:
            async with gate:
                home = self.dispatch.place(group)  # the group's server, placed by load when its first sample is let in
                attempts = functools.partial(self._attempts, aborts=aborts, home=home)
                sample, aborted = await self._continued(attempts, http, prompt, group_id, seed, start, budget, counters)
        finally:
            self.dispatch.sample_done(group)
        if aborted:
            sample.finish_reason = "length"  # the whole budget was generated before the abort
        if sample.token_versions is not None and np.unique(sample.token_versions).size > 1:
            counters.partial_samples += 1
        return sample

    async def _continued(self, attempts, http, prompt, group_id, seed, start, budget, counters):
        """One sample's request and, in ``pause_mode="abort"``, its continuations: (sample, aborted)."""
        sample, aborted = await attempts(http, prompt, group_id, seed, start, budget, counters)
        for _ in range(self.max_continuations):
            k = 0 if sample is None else len(sample.response_ids)
            if not aborted or k >= budget:
                break
            counters.continued_requests += 1
            if k == 0:  # ended before its first token (still queued, or in prefill): ask again, same request
                sample, aborted = await attempts(http, prompt, group_id, seed, start, budget, counters)
                continue
            head_prompt = continuation_prompt(sample)  # rows before len - 1 came with the aborted reply
            tail, aborted = await attempts(
                http, head_prompt, group_id, continuation_seed(seed, k), len(head_prompt) - 1, budget - k, counters
            )
            if tail is not None:  # None: the continuation itself was aborted while queued; send it again
                sample = stitch(sample, tail)
        if aborted and (sample is None or len(sample.response_ids) < budget):
            raise RolloutRequestError(
                f"a sample was aborted {self.max_continuations + 1} times (by a pause, or at its bound "
                f"rollout.request_timeout_s={self.request_timeout_s:g}; max_continuations)"
            )
        return sample, aborted

    async def _attempts(
        self,
        http,
        prompt,
        group_id,
        seed,
        start,
        max_new_tokens,
        counters: PartialCounters | None = None,
        aborts: OutsideAborts | None = None,
        home: int | None = None,
    ) -> tuple[RolloutSample | None, bool]:
        """One request with retries: (sample, whether a pause or the request's bound aborted it); the sample is None
        when the abort came before its first token or while it sat in the waiting queue (``is_queued_abort``:
        no routes in the reply, nothing to continue from): it is sent again whole. A request past its bound
        (``request_timeout_s``) is aborted by this client (``http_session.post_generate``) and continued like a
        pause's abort, in any pause mode. Otherwise, outside ``pause_mode="abort"``, an abort_all's reply is an
        outside abort (``aborts``): retried like a 5xx, within ``max_retries``."""
        body = self.request_body(prompt, seed, start, max_new_tokens)
        errors = []
        order = self.dispatch.order(home)  # the group's server first; a retry moves to the next server in it
        for attempt in range(self.max_retries + 1):
            index = order[attempt % len(order)]
            url = self.addresses[index]
            self.dispatch.sending(index)
            try:
                reply, bound_hit = await self._post(http, url, {**body, "rid": uuid.uuid4().hex})
                meta = reply.get("meta_info") or {}
                own = bound_hit and is_pause_abort(meta)  # this client aborted it at its bound: continue it
                if self.pause_mode != "abort" and not own and is_pause_abort(meta):
                    raise Retryable((aborts or OutsideAborts()).count_one(url, meta))
                paused = (own or self.pause_mode == "abort") and is_pause_abort(meta)
                if own:
                    logger.warning(
                        "rollout: a request ran past its %g s bound (rollout.request_timeout_s) on %s; aborted there "
                        "after %d token(s), continued from them (max_continuations=%d)",
                        *(self.request_timeout_s, url, len(reply["output_ids"]), self.max_continuations),
                    )
                if paused and (not reply["output_ids"] or is_queued_abort(meta)):
                    return None, True
                sample = self._to_sample(reply, prompt, group_id, url, start, own=own)
                if self.pause_mode == "in_place":
                    (counters or self.partial_counters).kv_stale_tokens += kv_stale_tokens(
                        reply["meta_info"], len(sample.response_ids)
                    )
                return sample, paused
            except Retryable as err:
                errors.append(f"attempt {attempt + 1} at {url}: {err}")
            finally:
                self.dispatch.replied(index)
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise RolloutError(
            f"/generate failed after {self.max_retries + 1} attempts (max_retries={self.max_retries}); "
            + "; ".join(errors)
        )

    async def _post(self, http, url: str, body: dict) -> tuple[dict, bool]:
        """The reply to ``body`` and whether it ran past its bound (then this client aborted it: http_session)."""
        grace = self.health_timeout_s or ABORT_GRACE_S
        try:
            status, raw, bound_hit = await http.post_generate(
                url, body, self.request_timeout_s, grace, self.admin_headers or None
            )
        except http_session.TransportFailure as err:  # refused, reset, closed mid-reply, no reply after the abort
            raise Retryable(str(err)) from err
        if status == 200:
            self._replied[url] = time.monotonic()  # the scheduler generated: proof of health (health.py)
        return read_reply(url, status, raw), bound_hit

    def _to_sample(
        self, reply: dict, prompt: np.ndarray, group_id: int, url: str, start: int = 0, own: bool = False
    ) -> RolloutSample:
        mode = "abort" if own else self.pause_mode  # an abort of this client's own (the bound) is continued
        return reply_to_sample(reply, prompt, group_id, url, start, self.route_spec, self.vocab_size, mode)
