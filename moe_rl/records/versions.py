"""Weight versions in records: the label grammar and the per-token ``token_versions`` array.

Owns the weight-version label ``step-<s>`` or ``step-<s>-<nonce>`` (the trainer's form: the nonce comes
from the run id, so two runs sharing servers never carry the same label), optionally ``.partial`` while a
tensor sync is half-way; its version number is the integer ``s``: the weights at the start of RL step
``s``, i.e. after RL steps ``0 … s-1`` of the run (the initial weights are version 0). And the records'
``token_versions`` (int32, one per response token): the version that generated each token. Without
partial rollouts every token of a sample has its sample's version; records written before the array
existed load with exactly that (``token_versions_of``). An environment token of a multi-turn trajectory
(``trajectory.py``) has version -1: no weights generated it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from moe_rl.records.routes import RecordError

__all__ = [
    "VersionLabel",
    "check_token_versions",
    "parse_version_label",
    "stack_token_versions",
    "token_version_summary",
    "token_versions_of",
    "version_label",
    "version_number",
]

_LABEL = re.compile(r"step-(\d+)(?:-([0-9a-z]+))?(\.partial)?")


class VersionLabel(NamedTuple):
    step: int  # the version number
    nonce: str | None  # the run's nonce (None in the plain ``step-<s>`` form)
    partial: bool  # ``.partial``: a tensor sync stopped half-way


def version_label(step: int, nonce: str | None = None) -> str:
    """``step-<step>`` or ``step-<step>-<nonce>``."""
    if nonce is not None and not re.fullmatch(r"[0-9a-z]+", nonce):
        raise ValueError(f"weight-version nonce {nonce!r}; expected lowercase letters and digits")
    return f"step-{int(step)}" + (f"-{nonce}" if nonce else "")


def parse_version_label(label: str) -> VersionLabel:
    """The parts of a label in either form; ValueError naming the expected forms otherwise."""
    m = _LABEL.fullmatch(str(label))
    if m is None:
        raise ValueError(f"weight version {label!r} is not a label of the form step-<s> or step-<s>-<nonce>")
    return VersionLabel(int(m.group(1)), m.group(2), bool(m.group(3)))


def version_number(label: str) -> int:
    """The integer ``s`` of ``step-<s>`` / ``step-<s>-<nonce>``."""
    return parse_version_label(label).step


def _sample_version(label: str) -> int | None:
    try:
        parsed = parse_version_label(label)
    except ValueError:
        return None
    return None if parsed.partial else parsed.step


def stack_token_versions(samples) -> np.ndarray | None:
    """``token_versions[sum R]`` of samples: each sample's own array, else its label's version on every
    token; None when a sample has neither (a label that is not a trainer version, e.g. hand-made records)."""
    parts = []
    for s in samples:
        if s.token_versions is not None:
            parts.append(np.asarray(s.token_versions, np.int32))
            continue
        version = _sample_version(s.weight_version)
        if version is None:
            return None
        parts.append(np.full(len(s.response_ids), version, np.int32))
    return np.concatenate(parts)


def check_token_versions(batch) -> None:
    """One version >= 0 per response token, never newer than the sample's reported ``weight_version``."""
    tv = batch.token_versions
    if tv is None:
        return
    tokens = int(batch.response_lens.sum())
    if tv.ndim != 1 or tv.dtype.kind not in "iu" or tv.shape != (tokens,):
        raise RecordError(
            f"token_versions must be a 1-D integer array with one entry per response token "
            f"({tokens}), got {tv.dtype} with shape {tv.shape}"
        )
    generated = tv if batch.role_mask is None else tv[batch.role_mask == 1]  # environment tokens: -1
    if generated.size and generated.min() < 0:
        raise RecordError(f"token_versions has a negative version ({int(generated.min())})")
    ends = np.cumsum(batch.response_lens.astype(np.int64))
    for i, label in enumerate(batch.weight_versions):
        version = _sample_version(label)
        r = tv[ends[i] - batch.response_lens[i] : ends[i]]
        if version is not None and r.size and int(r.max()) > version:
            raise RecordError(
                f"sample {i}: token_versions reach {int(r.max())}, newer than its weight_version "
                f"{label!r} (the version that finished it)"
            )


def token_versions_of(batch) -> np.ndarray | None:
    """Per response token version of ``batch``: the stored array, or (older records) each sample's label
    version on its tokens; None when some sample's label is no trainer version."""
    if batch.token_versions is not None:
        return batch.token_versions
    versions = [_sample_version(label) for label in batch.weight_versions]  # per-sample data: any rank's share
    if any(v is None for v in versions):
        return None
    return np.repeat(np.asarray(versions, np.int32), batch.response_lens.astype(np.int64))


def token_version_summary(batch) -> dict:
    """``token_versions`` range and the share of samples spanning more than one version (records inspect)."""
    tv = token_versions_of(batch)
    if tv is None or not tv.size:
        return {}
    ends = np.cumsum(batch.response_lens.astype(np.int64))
    gen = np.ones(tv.shape, bool) if batch.role_mask is None else batch.role_mask.astype(bool)  # environment: -1
    spans = [np.unique(tv[e - n : e][gen[e - n : e]]).size > 1 for e, n in zip(ends, batch.response_lens)]
    return {"token_versions": [int(tv[gen].min()), int(tv[gen].max())], "partial_samples": int(sum(spans))}
