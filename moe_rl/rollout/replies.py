"""What one SGLang ``/generate`` reply means: the rollout errors, and a reply read into a ``RolloutSample``.

Owns the error classes of the rollout client (what is retried and what is not: ``OutsideAborts`` counts a batch's
requests aborted by an admin call from outside the run, which the client sends again), reading a reply's HTTP status
and body, and checking and decoding it into one sample (``moe_rl.records.decode_sglang_meta``, per-token weight
versions from ``moe_rl.rollout.partial``). It sends nothing: requests, retries and servers are ``client``'s.
"""

from __future__ import annotations

import json

import numpy as np

from moe_rl.records import RecordError, RolloutSample, RouteSpec, decode_sglang_meta
from moe_rl.rollout.partial import (
    PartialRolloutError,
    check_version_spans,
    is_pause_abort,
    token_versions_from_meta,
)


class RolloutError(RuntimeError):
    """A batch could not be generated whole (server unreachable, 4xx, malformed reply)."""


class RolloutRequestError(RolloutError):
    """The server rejected a request (HTTP 4xx, or a generation it aborted for a reason of its own): not retried.
    An abort_all's reply (an outside abort: ``OutsideAborts``) is retried by the client instead."""


class RolloutResponseError(RolloutError):
    """A reply did not match the request or the model (e.g. routes of the wrong size): not retried."""


class Retryable(Exception):
    """Connection error or 5xx: worth another try, possibly on another server."""


class OutsideAborts:
    """One batch's requests aborted by an outside call (a request's event loop only: no lock needed)."""

    def __init__(self):
        self.count, self.first = 0, ""

    def count_one(self, url: str, meta_info: dict) -> str:
        why = f"{url} aborted the request ({meta_info['finish_reason'].get('message')!r}): an outside abort"
        self.count += 1
        self.first = self.first or why
        return why


def read_reply(url: str, status: int, raw: bytes) -> dict:
    """The JSON reply of ``{url}/generate`` from its HTTP status and body: ``Retryable`` on 5xx,
    ``RolloutRequestError`` on 4xx, ``RolloutResponseError`` for a body that is not a reply."""
    if status >= 500:
        raise Retryable(f"HTTP {status}: {raw[:300].decode(errors='replace')}")
    if status >= 400:
        raise RolloutRequestError(
            f"{url}/generate rejected the request, HTTP {status}: {raw[:500].decode(errors='replace')}"
        )
    try:
        reply = json.loads(raw)
    except ValueError as err:
        raise RolloutResponseError(
            f"{url}/generate replied with non-JSON: {raw[:300].decode(errors='replace')!r}"
        ) from err
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict) or "output_ids" not in reply:
        raise RolloutResponseError(f"{url}/generate reply lacks 'output_ids'/'meta_info': {str(reply)[:300]}")
    return reply


def reply_to_sample(
    reply: dict,
    prompt: np.ndarray,
    group_id: int,
    url: str,
    start: int,
    route_spec: RouteSpec | None,
    vocab_size: int,
    pause_mode: str | None,
) -> RolloutSample:
    """The sample of one reply to ``prompt``, checked against the request and the model (route rows from
    ``start`` on); an abort other than a pause's (``pause_mode="abort"``) is a ``RolloutRequestError``."""
    meta = reply["meta_info"]
    finish = meta.get("finish_reason")
    if (
        isinstance(finish, dict)
        and finish.get("type") == "abort"
        and not (pause_mode == "abort" and is_pause_abort(meta))
    ):
        raise RolloutRequestError(f"{url} aborted the generation: {finish.get('message', finish)}")
    if meta.get("prompt_tokens", len(prompt)) != len(prompt):
        raise RolloutResponseError(
            f"{url} reports prompt_tokens={meta.get('prompt_tokens')}; the request had {len(prompt)}"
        )
    response = np.asarray(reply["output_ids"], dtype=np.int32)
    try:
        check_version_spans(meta, pause_mode, url)
    except PartialRolloutError as err:
        raise RolloutResponseError(str(err)) from None
    try:
        decoded = decode_sglang_meta(meta, len(prompt), response, route_spec, vocab_size=vocab_size, start_len=start)
        token_versions = token_versions_from_meta(meta, len(response))
    except (RecordError, PartialRolloutError) as err:
        raise RolloutResponseError(f"malformed /generate reply from {url}: {err}") from err
    return RolloutSample(
        prompt_ids=prompt,
        response_ids=response,
        rollout_logp=decoded.rollout_logp,
        routes=decoded.routes,
        sampling_mask=decoded.sampling_mask,
        sampling_logp=decoded.sampling_logp,
        group_id=group_id,
        weight_version=decoded.weight_version,
        finish_reason=decoded.finish_reason,
        token_versions=token_versions,
    )
