"""Partial rollouts: pause in-flight generation around a weight update, and per-token provenance of a
response that spans it.

Owns ``rollout.partial`` / ``rollout.pause_mode`` on the rollout side (docs/sglang.md, "Partial rollouts"):

* ``paused_generation(addresses, mode, keys)``: ``POST /pause_generation {mode}`` on every server, yield,
  ``POST /continue_generation`` on every server (also when the body raised), every call with the admin key.
  SGLang's weight-update endpoints skip their writer lock while paused, so the push inside does not wait
  for in-flight requests; ``in_place`` must load without a cache flush (``PauseWindow.flush_cache``).
* Provenance of one reply: ``token_versions_from_meta`` turns SGLang's ``meta_info["weight_versions"]``
  spans (the version in force while each output token was sampled; retract and in_place keep one request
  across the update) into the int32 per-token array; ``kv_stale_tokens`` counts the tokens an ``in_place``
  request generated after an update on prefix KV of the old weights (approximate: no single version).
* ``abort``: SGLang ends every request at the pause, running or still queued; ``is_pause_abort``
  recognises such a reply and
  ``continuation`` / ``stitch`` turn it plus a continued request (prompt + tokens so far, only the new
  route rows) into one RolloutSample whose arrays keep each segment's own log-probs, routes and kept sets.
* ``PartialCounters``: what the trainer logs (``async/kv_stale_tokens``, ``async/partial_samples``,
  ``async/continued_requests``), accumulated per client and drained per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import httpx
import numpy as np

from moe_rl.records import RolloutSample
from moe_rl.records.versions import parse_version_label
from moe_rl.rollout.auth import ServerKeys, tls
from moe_rl.rollout.health import run_may_pause

PAUSE_MODES = ("retract", "abort", "in_place")
EXACT_PAUSE_MODES = ("retract", "abort")  # re-prefill under the new weights: every token has one version
SPANNING_PAUSE_MODES = ("retract", "in_place")  # one request is kept across the update: its reply needs spans
# SGLang's messages for requests ended by abort_all (pause_generation abort): a running request's
# FINISH_ABORT() ("Aborted"), and a still-queued one's (TokenizerManager._handle_abort_req's fallback)
QUEUED_ABORT_MESSAGE = "Abort in waiting queue"
PAUSE_ABORT_MESSAGES = ("Aborted", QUEUED_ABORT_MESSAGE)


class PartialRolloutError(RuntimeError):
    """A pause or continue call failed, or a reply's provenance cannot be stated; names the server."""


def check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"rollout.pause_mode={mode!r}; expected one of {PAUSE_MODES}")
    return mode


# ----------------------------------------------------------------------------------- pause / continue
@dataclass(frozen=True)
class PauseWindow:
    """What the weight push inside ``paused_generation`` must do."""

    mode: str
    addresses: tuple[str, ...]

    @property
    def flush_cache(self) -> bool:
        """``in_place`` keeps the running requests' KV: SGLang refuses a flush while they are live."""
        return self.mode != "in_place"


def _admin_post(address: str, path: str, body: dict, keys: ServerKeys | None, timeout_s: float) -> None:
    headers = keys.headers(admin=True) if keys else {}
    try:
        resp = httpx.post(f"{address}/{path}", json=body, headers=headers, timeout=timeout_s, verify=tls())
    except httpx.HTTPError as err:
        raise PartialRolloutError(f"{address}/{path} failed: {type(err).__name__}: {err}") from err
    if resp.status_code >= 400:
        raise PartialRolloutError(f"{address}/{path} refused, HTTP {resp.status_code}: {resp.text[:300]}")


@contextlib.contextmanager
def paused_generation(
    addresses: Sequence[str], mode: str, keys: ServerKeys | None = None, timeout_s: float = 120.0
) -> Iterator[PauseWindow]:
    """Pause every server's generation in ``mode`` for the body (a weight push), then continue them all.

    ``abort`` returns only after SGLang has ended every in-flight request (their replies come back aborted
    and the client continues them); ``retract`` puts running requests back in the waiting queue (their
    KV is freed and recomputed under the new weights); ``in_place`` freezes them with their KV. Servers
    paused before a failure are continued before PartialRolloutError is raised.
    """
    check_pause_mode(mode)
    addresses = tuple(a.rstrip("/") for a in addresses)
    paused: list[str] = []
    with run_may_pause():  # the run's own pause: the watchdog resumes none meanwhile (health.py)
        try:
            for address in addresses:
                _admin_post(address, "pause_generation", {"mode": mode}, keys, timeout_s)
                paused.append(address)
            yield PauseWindow(mode, addresses)
        finally:
            failures = []
            for address in paused:
                try:
                    _admin_post(address, "continue_generation", {}, keys, timeout_s)
                except PartialRolloutError as err:
                    failures.append(str(err))
            if failures:
                raise PartialRolloutError("servers left paused: " + "; ".join(failures))


# ----------------------------------------------------------------------------------- provenance
def token_versions_from_meta(meta_info: dict, response_len: int) -> np.ndarray | None:
    """int32 ``[R]``: the version number of the weights in force while each output token was sampled.

    From ``meta_info["weight_versions"]`` (spans ``{version, start, end}`` over output tokens; absent on
    servers without it: the reply's ``weight_version`` on every token). None when every label is not a
    trainer label (``step-<s>[-<nonce>]``) and the reply has one version: the sample's label speaks for
    it. A reply spanning labels that are not trainer labels raises PartialRolloutError.
    """
    spans = meta_info.get("weight_versions") or [
        {"version": meta_info.get("weight_version", ""), "start": 0, "end": response_len}
    ]
    out = np.full(response_len, -1, np.int32)
    for span in spans:
        try:
            label = parse_version_label(span["version"])
        except ValueError:
            if len(spans) > 1:
                raise PartialRolloutError(
                    f"a reply spans weight versions {[s['version'] for s in spans]}; a response spanning updates "
                    "needs trainer labels step-<s>[-<nonce>] to record token_versions"
                ) from None
            return None
        out[int(span["start"]) : int(span["end"])] = label.step
    if (out < 0).any():
        raise PartialRolloutError(f"weight_versions spans {spans} do not cover the {response_len} output tokens")
    return out


def check_version_spans(meta_info: dict, mode: str | None, url: str) -> None:
    """With ``rollout.partial`` in a mode that keeps one request across an update (retract, in_place), a reply
    must say which weights sampled each token (``meta_info["weight_versions"]``). A server that sends only
    the reply's last ``weight_version`` would have every token counted current -- staleness understated --
    so it is refused at its first reply, before any step trains on it. ``abort`` needs no spans: each
    request it continues is a new one, sampled under one version."""
    if mode in SPANNING_PAUSE_MODES and "weight_versions" not in meta_info:
        raise PartialRolloutError(
            f"{url} sends no per-token weight_versions spans in its /generate replies; rollout.partial with "
            f"rollout.pause_mode={mode!r} keeps requests across a weight update, so without them a token's version "
            "is unknown (it would count as current). Use the SGLang build moe_rl installs (it sends them) or "
            "rollout.pause_mode='abort'"
        )


def kv_stale_tokens(meta_info: dict, response_len: int) -> int:
    """Tokens generated after the first weight change within one request (``in_place``: on old-prefix KV)."""
    spans = meta_info.get("weight_versions") or []
    return response_len - min(int(spans[0]["end"]), response_len) if len(spans) > 1 else 0


def is_pause_abort(meta_info: dict) -> bool:
    """True for a reply ended by ``pause_generation(mode="abort")`` (SGLang's abort_all), not by an error:
    a running request ("Aborted") or one still in the waiting queue ("Abort in waiting queue", no tokens)."""
    finish = meta_info.get("finish_reason")
    return (
        isinstance(finish, dict)
        and finish.get("type") == "abort"
        and finish.get("message") in PAUSE_ABORT_MESSAGES
        and finish.get("status_code") is None
    )


def is_queued_abort(meta_info: dict) -> bool:
    """A pause abort of a request in SGLang's waiting queue (never scheduled, or retracted there): its reply
    has no routes or sampling masks and at most the tokens streamed before a retraction -- nothing a
    continuation can stand on, so the request is sent again whole."""
    return is_pause_abort(meta_info) and meta_info["finish_reason"].get("message") == QUEUED_ABORT_MESSAGE


def continuation_seed(seed: int | None, tokens_so_far: int) -> int | None:
    """The ``sampling_seed`` of a continued request: derived from the sample's seed and its length so far."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([int(seed), int(tokens_so_far)]).generate_state(1, np.uint32)[0])


def continuation_prompt(sample: RolloutSample) -> np.ndarray:
    """Prompt + response so far: the input of the continued request."""
    return np.concatenate([sample.prompt_ids, sample.response_ids]).astype(np.int32)


def stitch(head: RolloutSample, tail: RolloutSample) -> RolloutSample:
    """One sample from an aborted ``head`` and its continuation ``tail`` (``tail.prompt_ids`` = head's prompt +
    response; its routes start at row ``len(tail.prompt_ids) - 1``): each token keeps its own segment's
    log-prob, kept set, version and the route row of the forward pass that produced it."""
    p = len(head.prompt_ids)
    if len(tail.prompt_ids) != p + len(head.response_ids):
        raise PartialRolloutError(
            f"continuation prompt has {len(tail.prompt_ids)} tokens; expected {p + len(head.response_ids)}"
        )

    def cat(a, b):
        return None if a is None or b is None else np.concatenate([a, b])

    return RolloutSample(
        prompt_ids=head.prompt_ids,
        response_ids=np.concatenate([head.response_ids, tail.response_ids]).astype(np.int32),
        rollout_logp=np.concatenate([head.rollout_logp, tail.rollout_logp]).astype(np.float32),
        routes=cat(head.routes, tail.routes),
        sampling_mask=None
        if head.sampling_mask is None or tail.sampling_mask is None
        else [*head.sampling_mask, *tail.sampling_mask],
        sampling_logp=cat(head.sampling_logp, tail.sampling_logp),
        group_id=head.group_id,
        weight_version=tail.weight_version,
        finish_reason=tail.finish_reason,
        token_versions=cat(head.token_versions, tail.token_versions),
    )


# ----------------------------------------------------------------------------------- counters
@dataclass
class PartialCounters:
    """Per-client counts since the last ``drain``: what the trainer logs under ``async/``."""

    kv_stale_tokens: int = 0  # in_place: tokens sampled after an update on old-weight prefix KV (approximate)
    partial_samples: int = 0  # samples whose tokens come from more than one weight version
    continued_requests: int = 0  # abort: requests sent to continue an aborted reply
    FIELDS: ClassVar[tuple[str, ...]] = ("kv_stale_tokens", "partial_samples", "continued_requests")

    def drain(self) -> dict[str, int]:
        """``{"async/kv_stale_tokens": n, ...}`` since the last drain, and reset."""
        out = {f"async/{name}": getattr(self, name) for name in self.FIELDS}
        for name in self.FIELDS:
            setattr(self, name, 0)
        return out
