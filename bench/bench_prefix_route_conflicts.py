"""Measure what prefix route conflicts across turns do to the learner's log-probs (issue 56 item 3; docs/findings.md).

Normal (non-exact) mode as a config ships it: bf16 deterministic SGLang CPU rollout, fp32 Megatron-Core learner,
R3. A two-turn agent (turn 1, three environment tokens, turn 2 -- tests/exact/trajectory_agent.py's shape) runs with
``rollout.agent_check_prefix_routes=true``, so turn 2's request asks for every route row; its prefill's recomputed
rows of the prefix are kept here (moe_rl only counts them) next to the recorded rows the trajectory keeps.

Per trajectory, the learner (the same weights, fp32) scores every token once per route set:

* ``recorded``: the trajectory's rows -- what moe_rl stores and R3 replays;
* ``recomputed``: the same rows, with the prefix ``[0, t1 - 1)`` replaced by turn 2's prefill's recomputation;
* ``natural``: no replay (the learner's own top-k).

Reported: the conflict rate per compared position and per (position, MoE layer), split into prompt rows
(prefill vs prefill) and turn-1 generated rows (decode vs prefill); ``|recorded - recomputed|`` on turn-1 and on
turn-2 generated tokens; and each route set's ``|learner - rollout|`` against the behaviour log-probs.

Run: .venv/bin/python bench/bench_prefix_route_conflicts.py --config configs/cpu_midsize.yaml --out X.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_rl.config import load_config
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.train_step import Learner
from moe_rl.records import RouteSpec
from moe_rl.replay.binding import RoutingReplay
from moe_rl.rollout.agents import AgentSample, run_agents
from moe_rl.rollout.client import RolloutClient, SamplingSettings
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec
from moe_rl.rollout.turns import Trajectory
from moe_rl.tasks.synthetic import DigitTask
from moe_rl.train.warm_start import apply_warm_start

ENV = [3, 5, 7]  # the environment's reply between the turns, as tokens (tests/exact/trajectory_agent.py)


class RecomputedRows(Trajectory):
    """A trajectory that also keeps the rows a later turn's prefill recomputed for its prefix (moe_rl drops them
    after counting the conflicts)."""

    def _add_routes(self, rows, start, routes_from):
        if routes_from < start:
            self.marks["recomputed"] = np.array(rows[: start - routes_from])
        super()._add_routes(rows, start, routes_from)


async def two_turns(sample, generate) -> Trajectory:
    traj = RecomputedRows(group_id=sample.group_id)
    await generate(traj, sample.prompt_ids)
    traj.marks["t1"] = len(traj)  # prompt + turn 1
    traj.marks["prompt_len"] = len(sample.prompt_ids)
    await generate(traj, traj.token_ids.tolist() + ENV)
    return traj


def _logp(model, replay, tokens, temperature, routes=None) -> np.ndarray:
    ids = torch.as_tensor(tokens[:-1], dtype=torch.long)[None]
    tgt = torch.as_tensor(tokens[1:], dtype=torch.long)[None]
    with torch.no_grad():
        if routes is None:
            logp, _ = response_logprobs(model, ids, tgt, temperature=temperature, with_entropy=False)
        else:
            with replay.replay([torch.as_tensor(routes)[None]], observe_natural=False):
                logp, _ = response_logprobs(model, ids, tgt, temperature=temperature, with_entropy=False)
    return logp[0].double().cpu().numpy()


def _stats(x: list[float]) -> dict:
    a = np.abs(np.asarray(x, np.float64))
    if not a.size:
        return {"n": 0}
    return {"n": int(a.size), "max": float(a.max()), "mean": float(a.mean()), "p99": float(np.quantile(a, 0.99))}


def measure(cfg, trajectories, model, replay) -> dict:
    temp = cfg.rollout.temperature
    conf = {"prompt": [], "generated": []}  # per compared position: bool [L] (layer's expert set differs)
    d = {k: {"turn1": [], "turn2": []} for k in ("recorded_vs_recomputed", "recorded", "recomputed", "natural")}
    d_conflicted = {"turn1": [], "turn2": []}  # recorded vs recomputed, trajectories with >= 1 conflict only
    closer = {t: {"recorded": 0, "recomputed": 0, "tie": 0} for t in ("turn1", "turn2")}  # to the rollout's logp
    for traj in trajectories:
        t1, p = traj.marks["t1"], traj.marks["prompt_len"]
        rec, new = traj.routes[: t1 - 1], traj.marks["recomputed"]
        differs = (np.sort(rec, -1) != np.sort(new, -1)).any(-1)  # [t1 - 1, L]
        conf["prompt"] += list(differs[:p])
        conf["generated"] += list(differs[p:])
        mixed = traj.routes.copy()
        mixed[: t1 - 1] = new
        tokens = traj.token_ids
        lp = {
            "recorded": _logp(model, replay, tokens, temp, traj.routes),
            "recomputed": _logp(model, replay, tokens, temp, mixed),
            "natural": _logp(model, replay, tokens, temp),
        }
        pos = 0
        for seg in traj.segments:
            if seg.role == "generated":
                turn = f"turn{seg.turn}"
                idx = np.arange(pos, pos + len(seg)) - 1  # logp[j] scores token j + 1
                d["recorded_vs_recomputed"][turn] += list(lp["recorded"][idx] - lp["recomputed"][idx])
                if differs.any():
                    d_conflicted[turn] += list(lp["recorded"][idx] - lp["recomputed"][idx])
                for k in ("recorded", "recomputed", "natural"):
                    d[k][turn] += list(lp[k][idx] - seg.logp.astype(np.float64))
                err_a = np.abs(lp["recorded"][idx] - seg.logp)
                err_b = np.abs(lp["recomputed"][idx] - seg.logp)
                closer[turn]["recorded"] += int((err_a < err_b).sum())
                closer[turn]["recomputed"] += int((err_b < err_a).sum())
                closer[turn]["tie"] += int((err_a == err_b).sum())
            pos += len(seg)
    out = {"conflicting_positions": 0}
    for where, rows in conf.items():
        rows = np.asarray(rows, bool).reshape(-1, replay.num_moe_layers)
        out[f"{where}_positions"] = len(rows)
        out["conflicting_positions"] += int(rows.any(-1).sum())
        out[f"{where}_conflict_rate_per_token"] = float(rows.any(-1).mean()) if len(rows) else None
        out[f"{where}_conflict_rate_per_layer"] = [float(v) for v in rows.mean(0)] if len(rows) else None
    return {
        "conflicts": out,
        "trajectories_with_conflicts": int(
            sum(t.metrics["replay/turn_prefix_route_conflicts"] > 0 for t in trajectories)
        ),
        "abs_dlogp_recorded_vs_recomputed": {t: _stats(v) for t, v in d["recorded_vs_recomputed"].items()},
        "abs_dlogp_recorded_vs_recomputed_conflicted_only": {t: _stats(v) for t, v in d_conflicted.items()},
        "closer_to_rollout_logp": closer,
        "abs_learner_minus_rollout": {
            k: {t: _stats(v) for t, v in d[k].items()} for k in ("recorded", "recomputed", "natural")
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/cpu_midsize.yaml")
    ap.add_argument("--set", action="append", default=[], help="config override section.key=value (repeatable)")
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--turn-tokens", type=int, default=16, help="rollout.max_new_tokens (each turn)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    overrides = [f"rollout.max_new_tokens={args.turn_tokens}", "rollout.agent_check_prefix_routes=true", *args.set]
    cfg = load_config(args.config, overrides)
    assert not cfg.rollout.true_on_policy, "this measures normal mode; true-on-policy has no conflicts (tests/exact)"
    init_distributed(cfg.parallel, environ={})
    learner = Learner(cfg, total_steps=1)
    warm = apply_warm_start(learner, cfg)
    model = learner.module.eval()
    replay = RoutingReplay(model)
    task = DigitTask(cfg.train.task, cfg.model.vocab_size)
    prompts = task.sample_prompts(args.trajectories, np.random.default_rng(cfg.train.seed))
    samples = [AgentSample(prompt_ids=p.ids, group_id=i) for i, p in enumerate(prompts)]
    with tempfile.TemporaryDirectory(prefix="prefix_routes_") as tmp:
        hf_dir = learner.export_hf(Path(tmp) / "hf")
        spec = ServerSpec.from_rollout_config(cfg.rollout, hf_dir, startup_timeout_s=600)
        with SGLangServer(spec, Path(tmp) / "server.log") as server:
            client = RolloutClient(
                [server.url],
                RouteSpec.from_model_config(cfg.model),
                cfg.model.vocab_size,
                SamplingSettings.from_rollout_config(cfg.rollout),
                seed=cfg.rollout.seed,
                max_concurrency=8,
            )
            trajs, counters = asyncio.run(run_agents(two_turns, samples, client, check_prefix_routes=True))
        # with deterministic inference on the CPU attention backend SGLang turns the radix cache off: turn 2's
        # prefill recomputes the whole prefix (its KV and its routes) rather than reusing turn 1's
        radix_off = "radix cache is not compatible" in (Path(tmp) / "server.log").read_text(errors="replace")
    result = measure(cfg, trajs, model, replay)
    result["moe_rl_counter"] = int(counters.get("replay/turn_prefix_route_conflicts", 0))
    lens = [[len(s) for s in t.segments if s.role == "generated"] for t in trajs]
    report = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "sglang": metadata.version("sglang"),
        },
        "config": {
            "file": args.config,
            "overrides": overrides,
            "model": {
                k: getattr(cfg.model, k) for k in ("num_layers", "hidden_size", "num_moe_experts", "moe_router_topk")
            },
            "rollout_dtype": cfg.rollout.dtype,
            "deterministic": cfg.rollout.deterministic,
            "radix_cache_disabled_by_server": radix_off,
            "true_on_policy": cfg.rollout.true_on_policy,
            "learner_params_dtype": cfg.precision.params_dtype,
            "sampling": [cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k],
            "warm_start": None if warm is None else {k: warm[k] for k in ("cached", "nll_first", "nll_last")},
            "task": cfg.train.task,
            "env_tokens": ENV,
            "trajectories": len(trajs),
            "turn_tokens_mean": [float(np.mean([x[i] for x in lens])) for i in range(2)],
        },
        **result,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
