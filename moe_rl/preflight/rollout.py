"""Preflight rules of the rollout side: sampling, the rollout mode, partial rollouts, reachable servers.

Owns the config rules the rollout client and the producer would refuse (a top-k that samples nothing or
exceeds the kept-set cap, async mode without servers, partial rollouts outside async mode), the note on
approximate ``in_place`` pauses, the agent-loop keys (``agent_loop``: importable; no ReMax), and the environment
rule that every ``rollout.addresses`` server answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import httpx

from moe_rl.config import ExperimentConfig
from moe_rl.rollout.agents import AgentError, load_tools, resolve_spec

__all__ = [
    "agent_loop",
    "external_server_key_notes",
    "partial_rollout_notes",
    "partial_rollouts",
    "rollout_addresses",
    "rollout_mode",
    "sampling_settings",
    "server_keys",
]


def sampling_settings(cfg: ExperimentConfig) -> Iterable[str]:
    r = cfg.rollout
    if r.top_k == 0:
        yield "rollout.top_k=0 samples from no token; expected -1 (no top-k) or >= 1"
    if cfg.replay.keep_sampling_mask and r.top_k > r.sampling_mask_max_tokens:
        yield (
            f"rollout.top_k={r.top_k} exceeds rollout.sampling_mask_max_tokens={r.sampling_mask_max_tokens} "
            "(the largest kept set SGLang returns for replay.keep_sampling_mask); lower top_k or raise the cap"
        )


def agent_loop(cfg: ExperimentConfig) -> Iterable[str]:
    """``rollout.agent`` / ``rollout.tools`` must import; ReMax's greedy baseline is single-turn (docs/agents.md). Sync,
    async and partial rollouts all run agent loops."""
    r = cfg.rollout
    try:
        if r.agent is not None:
            resolve_spec(r.agent, "rollout.agent")
        load_tools(r.tools)
    except AgentError as err:
        yield str(err)
        return
    if r.tools and r.agent is None:
        yield "rollout.tools lists tools but rollout.agent is None; the tools are called only by an agent loop"
    if r.agent is not None and cfg.advantage.estimator == "remax":
        yield (
            f"rollout.agent={r.agent!r} with advantage.estimator=remax: ReMax's greedy baseline response is not "
            "built for agent loops; choose another advantage.estimator"
        )


def rollout_mode(cfg: ExperimentConfig) -> Iterable[str]:
    """Asynchronous rollouts need a producer: servers to generate from (docs/training.md, 'sync -> async')."""
    if cfg.train.rollout_mode == "async" and cfg.train.rollouts_from:
        yield (
            "train.rollout_mode=async overlaps generation with training; train.rollouts_from trains on saved "
            "records without servers (set train.rollout_mode=sync)"
        )


def partial_rollouts(cfg: ExperimentConfig) -> Iterable[str]:
    """A weight update interrupts in-flight requests only where rollouts overlap training."""
    mode = cfg.train.rollout_mode
    if cfg.rollout.partial and mode != "async":
        yield (
            f"rollout.partial=true pauses in-flight requests at a weight update, which only the asynchronous "
            f"producer has in flight; train.rollout_mode={mode!r}: expected rollout.partial=false or "
            "train.rollout_mode=async"
        )


def partial_rollout_notes(cfg: ExperimentConfig) -> Iterable[str]:
    if cfg.rollout.partial and cfg.rollout.pause_mode == "in_place":
        yield (
            "rollout.pause_mode=in_place is approximate: tokens sampled after a weight update attend to prefix KV the "
            "old weights computed, so they match no single weight version; they are recorded at the new version "
            "and counted as async/kv_stale_tokens (retract or abort re-prefill and are exact; docs/sglang.md)"
            + (
                "; with rollout.deterministic=false the radix cache is on and not flushed at the update, so later "
                "requests may reuse old-weight prefix KV that is not counted"
                if not cfg.rollout.deterministic
                else ""
            )
        )


# --- environment rules --------------------------------------------------------------------------


def server_keys(cfg: ExperimentConfig, environ: Mapping[str, str]) -> Iterable[str]:
    r = cfg.rollout
    api, admin = environ.get(r.api_key_env or ""), environ.get(r.admin_api_key_env or "")
    if api and admin and api == admin:
        yield (
            f"rollout.api_key_env={r.api_key_env!r} and rollout.admin_api_key_env={r.admin_api_key_env!r} hold the "
            "same key: every client that may generate could also push weights; expected two different keys"
        )


def external_server_key_notes(cfg: ExperimentConfig) -> Iterable[str]:
    r = cfg.rollout
    if r.addresses and r.api_key_env and not r.admin_api_key_env:
        yield (
            f"rollout.addresses with rollout.api_key_env={r.api_key_env!r} and no rollout.admin_api_key_env: servers "
            "started without an admin key accept the API key on their admin endpoints (weight updates); moe_rl does "
            "not start these servers and cannot change that (docs/operations.md)"
        )


def rollout_addresses(cfg: ExperimentConfig, environ: Mapping[str, str]) -> Iterable[str]:
    for url in cfg.rollout.addresses:
        try:
            httpx.get(f"{url.rstrip('/')}/health", timeout=5.0).raise_for_status()
        except (httpx.HTTPError, ValueError) as exc:
            yield f"rollout.addresses: {url}/health is not reachable ({type(exc).__name__}: {exc})"
