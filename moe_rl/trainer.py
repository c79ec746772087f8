"""The synchronous RL loop: rollout -> rewards -> advantages -> old log-probs -> N updates -> sync.

Owns the order of one RL step and its persistence (records before training, checkpoints,
metrics, exported weights). It contains no algorithm branches: losses and corrections come
from ``moe_rl.algo.compute_policy_loss``, routing from ``moe_rl.replay.ReplayDriver``, log-probs
from the learner. Per step ``s`` (all seeded by ``(train.seed, s)``, so a resumed run repeats
an uninterrupted one):

1. sample prompts; generate ``samples_per_prompt`` each on SGLang with routes, masks, log-probs;
2. score rewards, save the batch to ``<run>/rollouts/step_<s>.safetensors``;
3. GRPO/RLOO advantages; in decoupled mode the old log-prob pass (R3 replays rollout routes,
   R2 records the learner's own);
4. ``minibatches_per_step`` optimizer steps (times ``epochs_per_step``) under the replay driver;
5. export HF weights, ``/update_weights_from_disk`` to every server, checkpoint every K steps.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from moe_rl.algo import compute_advantages, compute_policy_loss
from moe_rl.batching import LearnerMicrobatch, build_microbatches, minibatch_split
from moe_rl.config import ExperimentConfig, save_config
from moe_rl.metrics_log import MetricsLogger
from moe_rl.records import RolloutBatch

ROLLOUTS_DIR = "rollouts"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def check_supported(cfg: ExperimentConfig) -> None:
    """Refuse settings the loop cannot honour yet, naming the key."""
    if cfg.loss.kl_coef:
        raise NotImplementedError("loss.kl_coef > 0 needs a reference model, which the trainer does not build yet")
    if cfg.replay.keep_sampling_mask and cfg.parallel.tp > 1:
        raise NotImplementedError("replay.keep_sampling_mask with parallel.tp > 1 (vocab-sharded logits) is not supported yet")


def make_logprob_fn(keep_sampling_mask: bool, with_entropy: bool):
    """``fn(model, mb, temperature) -> (logp[B, T], entropy | None)``; KSM renormalises over kept sets."""
    from moe_rl.learner.logprobs import logprobs_from_logits, response_logprobs
    from moe_rl.learner.model import forward_logits
    from moe_rl.replay.keep_mask import keep_mask_logprobs

    def logprob_fn(model, mb: dict, temperature: float):
        if not keep_sampling_mask or mb.get("kept") is None:
            return response_logprobs(model, mb["input_ids"], mb["targets"], temperature=temperature,
                                     with_entropy=with_entropy)  # fmt: skip
        logits = forward_logits(model, mb["input_ids"])
        B, T, V = logits.shape
        targets = mb["targets"].clamp(min=0)  # pad targets (-1) are masked out by the loss
        result = keep_mask_logprobs(logits.reshape(B * T, V), targets.reshape(-1), mb["kept"], temperature)
        entropy = logprobs_from_logits(logits, targets, temperature=temperature)[1] if with_entropy else None
        return result.logp.view(B, T), entropy

    return logprob_fn


def make_loss_fn(cfg: ExperimentConfig, loss_denominator: float):
    """``loss_fn(logp, entropy, mb)`` for the learner: the algo entry point with a global normaliser."""

    def loss_fn(logp, entropy, mb):
        return compute_policy_loss(
            cfg.loss, cfg.correction, logp, mb.get("old_logp"), mb["rollout_logp"], mb["advantages"], mb["mask"],
            entropy=entropy, loss_denominator=loss_denominator,
        )  # fmt: skip

    return loss_fn


def loss_denominator(cfg: ExperimentConfig, mbs: list[LearnerMicrobatch]) -> float:
    """Divisor that turns per-microbatch sums into the minibatch's aggregation (train_step divides by n)."""
    masks = [m.tensors["mask"] for m in mbs]
    if cfg.loss.aggregation == "token_mean":
        total = sum(int(m.sum()) for m in masks)
    elif cfg.loss.aggregation == "seq_mean_token_mean":
        total = sum(int(m.any(dim=1).sum()) for m in masks)
    else:
        total = sum(m.shape[0] for m in masks) * cfg.rollout.max_new_tokens
    return max(total, 1) / len(mbs)


class RLTrainer:
    """One experiment's learner, replay driver, task and sinks; ``run()`` drives the steps."""

    def __init__(self, cfg: ExperimentConfig):
        from moe_rl.learner.checkpoint import load_checkpoint
        from moe_rl.learner.dist import init_distributed
        from moe_rl.learner.train_step import Learner
        from moe_rl.replay.driver import ReplayDriver
        from moe_rl.rollout.tasks import build_task

        check_supported(cfg)
        self.cfg = cfg
        self.run_dir = Path(cfg.train.output_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        init_distributed(cfg.parallel)
        self.is_main = _rank() == 0
        if self.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
        self.learner = Learner(cfg)  # imports checkpoint.init_from_hf when set
        meta = load_checkpoint(self.learner, self.ckpt_dir) if cfg.checkpoint.resume == "auto" else None
        self.start_step = int(meta["extra"]["rl_step"]) if meta else 0
        if meta is None:  # a fresh run starts from the cached supervised warm start (train.warm_start)
            from moe_rl.train.warm_start import apply_warm_start

            apply_warm_start(self.learner, cfg)
        self.driver = ReplayDriver.from_config(self.learner.module, cfg)
        self.task, self.reward_fn = build_task(cfg.train, cfg.model.vocab_size)
        self.logprob_fn = make_logprob_fn(cfg.replay.keep_sampling_mask, with_entropy=cfg.loss.entropy_coef > 0)

    # ------------------------------------------------------------------ weights
    def export_weights(self) -> Path:
        """Export the learner as an HF dir for SGLang (collective); path of the live copy."""
        from moe_rl.learner.hf_convert import export_hf_checkpoint
        from moe_rl.rollout.quantize import quantize_hf_dir

        out = self.run_dir / "hf" / "current"
        export_hf_checkpoint(self.learner.module, self.cfg.model, out, template_dir=self.cfg.checkpoint.init_from_hf)
        if self.is_main and self.cfg.rollout.weight_quantization != "none":
            quantize_hf_dir(out, self.cfg.rollout.weight_quantization)
        _barrier()
        return out

    def sync_weights(self, addresses: list[str], step: int) -> float:
        from moe_rl.rollout.weights import update_weights_from_disk

        t0 = time.perf_counter()
        hf_dir = self.export_weights()
        if self.is_main:
            update_weights_from_disk(addresses, hf_dir, f"step-{step}")
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ one step
    def rollout(self, client, step: int) -> RolloutBatch:
        """Generate, score and persist this step's batch (rank 0); every rank returns the same batch."""
        path = self.run_dir / ROLLOUTS_DIR / f"step_{step:06d}.safetensors"
        if self.is_main:
            rng = np.random.default_rng([self.cfg.train.seed, step])
            prompts = self.task.sample_prompts(self.cfg.train.prompts_per_step, rng)
            n = self.cfg.rollout.samples_per_prompt
            samples = client.generate([p.ids for p in prompts], n, step=step)
            for k, sample in enumerate(samples):
                sample.reward = float(self.reward_fn(prompts[k // n], sample.response_ids.tolist()))
            batch = RolloutBatch.from_samples(samples, num_experts=self.cfg.model.num_moe_experts)
            batch.validate(self.cfg.model)
            batch.save(path)  # persisted before it is trained on
        _barrier()
        return RolloutBatch.load(path)

    def _dp_shard(self, ids: np.ndarray) -> np.ndarray:
        from megatron.core import parallel_state as ps

        return ids[ps.get_data_parallel_rank() :: ps.get_data_parallel_world_size()]

    def _microbatches(self, batch: RolloutBatch, ids, advantages) -> list[LearnerMicrobatch]:
        c = self.cfg
        return build_microbatches(
            batch, list(self._dp_shard(np.asarray(ids))), advantages, c.train.micro_batch_size,
            num_experts=c.model.num_moe_experts, use_kept_logp=c.replay.keep_sampling_mask,
            with_routes=batch.routes is not None, with_kept_sets=c.replay.keep_sampling_mask,
        )  # fmt: skip

    def old_logprobs(self, batch: RolloutBatch, advantages) -> dict[int, torch.Tensor]:
        """pi_old per sample (decoupled mode) under the replay driver's old-log-prob pass."""
        mbs = self._microbatches(batch, np.arange(len(batch)), advantages)
        out: dict[int, torch.Tensor] = {}
        model = self.learner.model
        model.eval()
        with torch.no_grad(), self.driver.old_logprob_pass([m.routes for m in mbs]):
            for m in mbs:
                logp, _ = self.logprob_fn(model, m.tensors, self.cfg.rollout.temperature)
                for b, sid in enumerate(m.tensors["sample_ids"]):
                    out[sid] = logp[b].float()
        return out

    def update(self, batch: RolloutBatch, advantages, old_logp, step: int) -> tuple[list, float]:
        """N minibatch optimizer steps (x epochs); returns their stats and the KSM outside-mask fraction."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.train.seed, step, 1])
        stats, outside, masked = [], 0, 0
        for _ in range(cfg.train.epochs_per_step):
            for ids in minibatch_split(len(batch), cfg.train.minibatches_per_step, rng):
                mbs = self._microbatches(batch, ids, advantages)
                for m in mbs:
                    if old_logp is not None:
                        T = m.tensors["mask"].shape[1]
                        m.tensors["old_logp"] = torch.stack([old_logp[s][:T] for s in m.tensors["sample_ids"]])
                    outside += m.num_outside_mask
                    masked += int(m.tensors["mask"].sum())
                loss_fn = make_loss_fn(cfg, loss_denominator(cfg, mbs))
                with self.driver.update_pass([m.routes for m in mbs]):
                    stats.append(self.learner.train_step([m.tensors for m in mbs], loss_fn,
                                                         cfg.rollout.temperature, self.logprob_fn))  # fmt: skip
        return stats, outside / max(masked, 1)

    def step(self, client, step: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        batch = self.rollout(client, step)
        t_rollout = time.perf_counter() - t0
        rewards = torch.from_numpy(batch.rewards).double()
        advantages = compute_advantages(cfg.advantage, rewards, cfg.rollout.samples_per_prompt).float()
        t1 = time.perf_counter()
        old = self.old_logprobs(batch, advantages) if cfg.correction.mode == "decoupled" else None
        t_old = time.perf_counter() - t1
        t2 = time.perf_counter()
        stats, ksm_outside = self.update(batch, advantages, old, step)
        t_train = time.perf_counter() - t2
        metrics = _mean([s.metrics | {"train/loss": s.loss, "train/grad_norm": s.grad_norm, "train/lr": s.lr}
                         for s in stats])  # fmt: skip
        metrics |= self.driver.step_metrics()
        metrics |= {
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()), "reward/max": float(rewards.max()),
            "response/len_mean": float(batch.response_lens.mean()),
            "response/truncated_frac": float(np.mean([f == "length" for f in batch.finish_reasons])),
            "ksm/outside_mask_frac": ksm_outside if cfg.replay.keep_sampling_mask else 0.0,
            "time/rollout_s": t_rollout, "time/old_logp_s": t_old, "time/train_s": t_train,
            "rollout/tokens_per_s": float(batch.response_lens.sum()) / max(t_rollout, 1e-9),
        }  # fmt: skip
        return metrics

    # ------------------------------------------------------------------ loop
    def run(self) -> Path:
        from moe_rl.learner.checkpoint import save_checkpoint
        from moe_rl.rollout.client import RolloutClient
        from moe_rl.rollout.launcher import rollout_servers

        cfg = self.cfg
        logger = MetricsLogger(self.run_dir, cfg.logging, cfg.train.steps, self.start_step, self.is_main, cfg.name)
        hf_dir = self.export_weights()
        servers = (rollout_servers(cfg.rollout, hf_dir, self.run_dir / "logs") if self.is_main
                   else contextlib.nullcontext([]))  # fmt: skip
        try:
            with servers as addresses:
                if self.is_main:  # label the served weights with our version (also for external servers)
                    from moe_rl.rollout.weights import update_weights_from_disk

                    update_weights_from_disk(addresses, hf_dir, f"step-{self.start_step}")
                client = RolloutClient.from_config(cfg, addresses) if self.is_main else None
                for step in range(self.start_step, cfg.train.steps):
                    t0 = time.perf_counter()
                    metrics = self.step(client, step)
                    metrics["time/sync_s"] = self.sync_weights(addresses, step + 1)
                    metrics["time/step_s"] = time.perf_counter() - t0
                    # log before checkpointing: a kill in between resumes from the older checkpoint,
                    # which cuts this line again, so no step's metrics can go missing
                    logger.log(step + 1, metrics)
                    if cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0 \
                            or step + 1 == cfg.train.steps:  # fmt: skip
                        save_checkpoint(self.learner, self.ckpt_dir, cfg.checkpoint.keep_last, extra={"rl_step": step + 1})
        finally:
            logger.close()
            self.driver.replay.close()  # release the routers (nothing stays bound after a run)
        return self.run_dir


def _mean(records: list[dict]) -> dict[str, float]:
    keys = sorted({k for r in records for k in r})
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}


def train(cfg: ExperimentConfig) -> Path:
    """Run RL training for ``cfg``; returns the run directory (metrics.jsonl, rollouts/, checkpoints/)."""
    return RLTrainer(cfg).run()
