"""A step's samples from ``rollout.agent``: the agent loop over every prompt, trajectories as records samples.

Owns the trainer's agent path (issue 56, docs/agents.md "Training on trajectories"): ``AgentRollouts`` loads the
loop once (``moe_rl.rollout.agents.load_agent`` with the run's tokenizer, tools and limits) and, for one
generation round, runs it over ``samples_per_prompt`` samples of every prompt (``run_agents``, in the order of
the client's batch: prompt-major), each turn on the run's ``RolloutClient``. ``trajectory_sample`` turns a
``Trajectory`` into one ``RolloutSample`` in the records' trajectory layout (``moe_rl.records.trajectory``):
prompt = the first prompt, response = every later token; environment tokens get log-prob 0.0, an empty kept set,
version -1 and role / loss mask 0; routes are the trajectory's stitched rows, one per forwarded position.
The sample's weight version and finish reason are its last turn's; its reward is the agent's ``reward`` when the
loop set one, else the run's reward function on the last turn's generated tokens.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np

from moe_rl.data.chat import load_tokenizer
from moe_rl.records import RolloutSample
from moe_rl.records.trajectory import NO_VERSION
from moe_rl.records.versions import parse_version_label
from moe_rl.rollout.agents import AgentContext, AgentError, AgentSample, load_agent, run_agents
from moe_rl.rollout.turns import Trajectory

__all__ = ["AgentRollouts", "agent_metrics", "reward_ids", "trajectory_sample"]


def _versions(seg) -> np.ndarray | None:
    if seg.token_versions is not None:
        return np.asarray(seg.token_versions, np.int32)
    try:
        label = parse_version_label(seg.weight_version)
    except ValueError:
        return None
    return None if label.partial else np.full(len(seg), label.step, np.int32)


def trajectory_sample(traj: Trajectory) -> RolloutSample:
    """One ``RolloutSample`` in the records' trajectory layout (module docstring)."""
    segs = traj.segments
    if len(segs) < 2 or segs[0].role != "prompt" or segs[-1].role != "generated":
        raise AgentError("the agent loop returned a trajectory without a prompt and a generated turn")
    rest = segs[1:]
    gen = [s for s in rest if s.role == "generated"]
    ksm = gen[0].sampling_mask is not None
    empty = np.zeros(0, np.int32)

    def per_token(get, fill, dtype):
        return np.concatenate(
            [np.asarray(get(s), dtype) if s.role == "generated" else np.full(len(s), fill, dtype) for s in rest]
        )

    versions = {id(s): _versions(s) for s in gen}
    last = gen[-1]
    return RolloutSample(
        prompt_ids=np.asarray(segs[0].token_ids, np.int32),
        response_ids=np.concatenate([s.token_ids for s in rest]).astype(np.int32),
        rollout_logp=per_token(lambda s: s.logp, 0.0, np.float32),
        routes=traj.routes,
        sampling_mask=[m for s in rest for m in (s.sampling_mask if s.role == "generated" else [empty] * len(s))]
        if ksm
        else None,
        sampling_logp=per_token(lambda s: s.sampling_logp, 0.0, np.float32) if ksm else None,
        group_id=traj.group_id,
        weight_version=last.weight_version,
        finish_reason=last.finish_reason,
        token_versions=None
        if any(v is None for v in versions.values())
        else per_token(lambda s: versions[id(s)], NO_VERSION, np.int32),
        role_mask=np.concatenate([np.full(len(s), s.role == "generated", np.uint8) for s in rest]),
        loss_mask=traj.loss_mask[len(segs[0]) :].astype(np.uint8),
        turn_ids=np.concatenate([np.full(len(s), s.turn, np.int32) for s in rest]),
        agent_reward=None if traj.reward is None else float(traj.reward),
    )


def reward_ids(sample: RolloutSample) -> np.ndarray:
    """What the reward function scores: the response (single turn), or a trajectory's last turn's tokens."""
    if sample.turn_ids is None:
        return sample.response_ids
    last = (sample.turn_ids == sample.turn_ids[-1]) & (np.asarray(sample.role_mask) == 1)
    return sample.response_ids[last]


class AgentRollouts:
    """``rollout.agent`` over one round's prompts. Thread-safe: in async mode several steps' batches generate at
    once (each on its own thread and event loop), so each batch passes its own ``metrics`` and ``counters``."""

    def __init__(self, cfg):
        r = cfg.rollout
        kwargs = cfg.data.chat_template_kwargs if cfg.data is not None else {}
        self.context = AgentContext.from_rollout_config(r, load_tokenizer(cfg), kwargs)
        self.agent = load_agent(r.agent, self.context)
        self.n, self.rerender, self.check_prefix_routes = (
            r.samples_per_prompt,
            r.agent_rerender,
            r.agent_check_prefix_routes,
        )

    def generate(
        self, client, prompts, step: int, group_ids=None, metrics: Counter | None = None, counters=None, n=None
    ) -> list[RolloutSample]:
        """``n`` (default ``samples_per_prompt``) trajectories of every prompt (prompt-major, as ``client.generate``);
        the loops' counters (``agent/*``, ``replay/*``) are added to ``metrics``, the turns' ``async/*`` counts to
        ``counters`` (the batch's ``PartialCounters``; default: the client's)."""
        groups = list(range(len(prompts))) if group_ids is None else list(group_ids)
        samples = [
            AgentSample(prompt_ids=list(p.ids), label=p.label, group_id=g, index=j, extra={"prompt": p})
            for p, g in zip(prompts, groups)
            for j in range(self.n if n is None else n)
        ]
        trajectories, counts = asyncio.run(
            run_agents(
                self.agent,
                samples,
                client,
                step=step,
                rerender=self.rerender,
                check_prefix_routes=self.check_prefix_routes,
                counters=counters,
            )
        )
        if metrics is not None:
            metrics.update(counts)
            metrics["agent/trajectories"] += len(trajectories)
            metrics["agent/turns"] += sum(t.turns for t in trajectories)
        return [trajectory_sample(t) for t in trajectories]


def agent_metrics(metrics: Counter) -> dict[str, float]:
    """A batch's agent counters as step metrics (``agent/turns_mean`` per trajectory)."""
    out = {k: float(v) for k, v in metrics.items()}
    if out.get("agent/trajectories"):
        out["agent/turns_mean"] = out.pop("agent/turns") / out["agent/trajectories"]
    return out
