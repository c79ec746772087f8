"""Zero-staleness mismatch diagnosis: same weights, same tokens, rollout engine vs learner.

Owns ``moe-rl diagnose``: generate once with SGLang (routes, kept sets, log-probs), then,
with no weight update in between, recompute the learner's log-probs of exactly those tokens
under four settings -- natural routing, R3, Keep Sampling Mask, R3 + KSM -- and measure the
gap each leaves (seed 000, "Identifying mismatch -- a diagnostic toolkit"; the zero-update
TIM test of VeXact). Verdict, plots and report files live in ``diagnose_report``.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from moe_rl.algo import metrics_to_floats, offpolicy_metrics
from moe_rl.config import ExperimentConfig
from moe_rl.records import RolloutBatch, RouteSpec
from moe_rl.rollout.client import RolloutClient
from moe_rl.rollout.server_pool import rollout_server_pool
from moe_rl.sizing import startup_timeout
from moe_rl.study.diagnose_report import write_report
from moe_rl.sync.transport import update_weights_from_disk
from moe_rl.train.batching import build_microbatch
from moe_rl.train.logprob import make_logprob_fn
from moe_rl.train.loop import RLTrainer

SETTINGS = {  # name -> (replay rollout routes, keep sampling mask)
    "natural": (False, False),
    "r3": (True, False),
    "ksm": (False, True),
    "r3_ksm": (True, True),
}
NUM_POSITION_BUCKETS = 8


def generate(trainer, num_prompts: int) -> RolloutBatch:
    """One rollout batch of ``num_prompts`` x samples_per_prompt with routes and kept sets, persisted."""

    cfg = trainer.cfg
    hf_dir = trainer.weights.export()  # applies rollout.weight_quantization (mismatch injection)
    startup = startup_timeout(cfg).value  # derived from the bytes to load when unset
    with rollout_server_pool(cfg.rollout, hf_dir, trainer.run_dir / "logs", startup_timeout_s=startup) as pool:
        addresses, trainer.server_keys = pool.addresses, pool.keys  # a generated admin key unless configured
        # labelled as the trainer's step 0, which trainer.rollout checks every sample against (issue 16)
        update_weights_from_disk(addresses, hf_dir, trainer.weights.version(0), keys=pool.keys)
        client = RolloutClient.from_config(
            cfg,
            addresses,
            route_spec=RouteSpec.from_model_config(cfg.model),
            return_sampling_mask=True,
            headers=pool.keys.headers(),
        )
        trainer.cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"prompts_per_step": num_prompts})})
        try:
            return trainer.rollout(client, step=0)
        finally:
            trainer.cfg = cfg


def learner_logprobs(trainer, batch: RolloutBatch, replay_routes: bool, keep_mask: bool) -> dict:
    """Learner log-probs of the batch's response tokens under one setting, plus flip metrics.

    Returns ``logp``/``mu`` as padded ``[N, R_max]`` float64 arrays (mu: the engine's full-vocab
    log-prob, or its kept-set-renormalised one under KSM), ``mask[N, R_max]`` and ``flips``.
    """

    cfg = trainer.cfg
    driver = trainer.driver
    ids = list(range(len(batch)))
    mbs = [
        build_microbatch(
            batch,
            ids[i : i + cfg.train.micro_batch_size],
            torch.zeros(len(batch)),
            num_experts=cfg.model.num_moe_experts,
            kept_logp=keep_mask,
            with_kept_sets=keep_mask,
            device=trainer.device,
        )
        for i in range(0, len(ids), cfg.train.micro_batch_size)
    ]
    logprob_fn = make_logprob_fn(keep_mask, with_entropy=False)
    R = int(batch.response_lens.max())
    logp, mu = np.zeros((len(batch), R)), np.zeros((len(batch), R))
    mask = np.zeros((len(batch), R), dtype=bool)
    trainer.learner.model.eval()
    with torch.no_grad(), driver.using("r3" if replay_routes else "none"), driver.update_pass([m.routes for m in mbs]):
        for m in mbs:
            out, _ = logprob_fn(trainer.learner.model, m.tensors, cfg.rollout.temperature)
            for b, sid in enumerate(m.tensors["sample_ids"]):
                row = m.tensors["mask"][b]
                n = int(row.sum())
                logp[sid, :n] = out[b][row].double().cpu().numpy()
                mu[sid, :n] = m.tensors["rollout_logp"][b][row].double().cpu().numpy()
                mask[sid, :n] = True
    return {"logp": logp, "mu": mu, "mask": mask, "flips": driver.step_metrics()}


def position_profile(logp: np.ndarray, mu: np.ndarray, mask: np.ndarray) -> list[dict]:
    """Max and mean ``|p_learner - p_rollout|`` per response-position bucket (seed 002's long-response view)."""
    diff = np.abs(np.exp(logp) - np.exp(mu))
    R = mask.shape[1]
    edges = np.unique(np.linspace(0, R, min(NUM_POSITION_BUCKETS, R) + 1).astype(int))
    out = []
    for lo, hi in itertools.pairwise(edges):
        m = mask[:, lo:hi]
        if m.any():
            d = diff[:, lo:hi][m]
            out.append({"positions": f"{lo}-{hi - 1}", "max_abs_dp": float(d.max()), "mean_abs_dp": float(d.mean())})
    return out


def measure(setting: dict) -> dict:
    """The numbers of one setting: algo's off-policy metrics (pi_learner vs mu) + flips + profile."""
    t = {k: torch.from_numpy(setting[k]) for k in ("logp", "mu", "mask")}
    numbers = metrics_to_floats(offpolicy_metrics(t["logp"], t["mu"], t["mask"]))
    numbers = {k.removeprefix("offpolicy/"): v for k, v in numbers.items()}
    flips = setting["flips"]
    numbers["flip_rate"] = flips.get("replay/rollout_vs_natural/response/flip_rate", float("nan"))
    numbers["tokens_with_flip"] = flips.get("replay/rollout_vs_natural/response/tokens_with_flip", float("nan"))
    numbers["dispatched_flip_rate"] = flips.get("replay/rollout_vs_dispatched/response/flip_rate", float("nan"))
    numbers["flip_rate_per_layer"] = {
        k.rsplit("/", 1)[1]: v
        for k, v in flips.items()
        if k.startswith("replay/rollout_vs_natural/response/flip_rate/")
    }
    numbers["by_position"] = position_profile(setting["logp"], setting["mu"], setting["mask"])
    return numbers


def run_diagnose(cfg: ExperimentConfig, num_prompts: int, out_dir: str | Path) -> dict:
    """Generate, recompute under every setting, write the report; returns all numbers (also ``numbers.json``)."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The trainer's run directory (HF export, checkpoints, server logs) is scratch: the report folder
    # gets the report, the numbers and the rollout records only. Kept (and named) if the diagnosis fails.
    scratch = Path(tempfile.mkdtemp(prefix="moe_rl_diagnose_"))
    cfg = cfg.model_copy(
        update={
            # one batch, generated here and now: the sync source (async would start a rollout process)
            # prompts_per_step here too: the batch source reads it when the trainer is built
            "train": cfg.train.model_copy(
                update={"output_dir": str(scratch), "rollout_mode": "sync", "prompts_per_step": num_prompts}
            ),
            "replay": cfg.replay.model_copy(update={"routing": "r3"}),  # bind replay; each setting picks its routing
            "logging": cfg.logging.model_copy(update={"progress": False, "tensorboard": False}),
        }
    )
    try:
        numbers = _diagnose_in(RLTrainer(cfg), cfg, num_prompts, out_dir)
    except BaseException:
        print(f"diagnose failed; its run directory (server logs, HF export) is kept: {scratch}", file=sys.stderr)
        raise
    shutil.rmtree(scratch, ignore_errors=True)
    return numbers


def _diagnose_in(trainer, cfg: ExperimentConfig, num_prompts: int, out_dir: Path) -> dict:
    """The diagnosis proper on a built trainer; releases it (routers, run lock) whatever happens."""

    try:
        batch = generate(trainer, num_prompts)
        batch.save(out_dir / "rollouts.safetensors")
        settings, arrays = {}, {}
        for name, (replay_routes, keep_mask) in SETTINGS.items():
            raw = learner_logprobs(trainer, batch, replay_routes, keep_mask)
            settings[name] = measure(raw)
            arrays.update({f"{name}/{k}": v for k, v in raw.items() if k != "flips"})
    finally:
        trainer.close()
    numbers = {
        "samples": len(batch),
        "response_tokens": int(batch.response_lens.sum()),
        "rollout": {"dtype": cfg.rollout.dtype, "weight_quantization": cfg.rollout.weight_quantization},
        "learner": {"params_dtype": cfg.precision.params_dtype},
        "ksm_outside_mask_tokens": _outside_count(batch),
        "settings": settings,
    }
    np.savez_compressed(out_dir / "per_token.npz", **arrays)
    write_report(numbers, arrays, out_dir)  # adds numbers["verdict"]
    (out_dir / "numbers.json").write_text(json.dumps(numbers, indent=1))
    return numbers


def _outside_count(batch: RolloutBatch) -> int:
    """Sampled tokens the engine's own kept set did not contain (cutoff disagreement)."""
    counts = np.diff(batch.mask_offsets)
    match = batch.mask_ids == np.repeat(batch.response_ids, counts)
    seg = np.repeat(np.arange(len(batch.response_ids)), counts)
    return int((np.bincount(seg[match], minlength=len(batch.response_ids)) == 0).sum())
