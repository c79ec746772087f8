"""The synchronous RL loop: rollout -> rewards -> advantages -> plan -> old log-probs -> updates -> sync.

Owns the order of one RL step and its persistence (records before training, checkpoints,
metrics, exported weights). It holds no algorithm branches (``moe_rl.algo``), no routing
decisions (``moe_rl.replay.ReplayDriver``) and no grouping decisions: which samples go to
which rank, minibatch and microbatch is the step's ``StepPlan`` (``moe_rl.train.plan``), which
``moe_rl.train.update`` executes. Per step ``s`` (all seeded by ``(train.seed, s)``, so a resumed
run repeats an uninterrupted one):

1. rank 0 takes the step's prompts from the prompt stream (``moe_rl.data``: the built-in task, or
   dataset rows at the position the last checkpoint saved), generates on SGLang (routes, masks,
   log-probs), scores rewards (``moe_rl.reward``) and saves ``<run>/rollouts/step_<s>.safetensors``
   before anything trains on it; every rank loads it (``StepRecords``: the bytes rank 0 wrote,
   checked against the model). With ``train.rollouts_from: DIR`` the records are read from ``DIR``
   instead (no server);
2. GRPO/RLOO advantages; the step plan; in decoupled mode the old-log-prob pass;
3. ``minibatches_per_step`` optimizer steps (times ``epochs_per_step``) under the replay driver;
4. export HF weights, ``/update_weights_from_disk`` to every server, checkpoint every K steps.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import numpy as np
import torch

from moe_rl.config import ExperimentConfig, save_config
from moe_rl.config.hf_model import side_files_dir
from moe_rl.config.preflight import ksm_active
from moe_rl.records import RecordError, RolloutBatch
from moe_rl.train.batching import check_ksm_records, kept_set_outside_fraction
from moe_rl.train.collectives import barrier, dp_group, dp_rank_and_size, is_main_process
from moe_rl.train.logprob import make_logprob_fn
from moe_rl.train.metrics_log import MetricsLogger
from moe_rl.train.plan import plan_step
from moe_rl.train.run_identity import resolve_run_id, version_nonce, write_checkpoint_identity, write_run_id
from moe_rl.train.step_records import StepRecords
from moe_rl.train.step_samples import StepSamples
from moe_rl.train.update import StepInputs, old_logprob_rows, reference_rows, update_minibatch

__all__ = ["RLTrainer", "train", "check_supported", "ROLLOUTS_DIR"]

ROLLOUTS_DIR = "rollouts"


def check_supported(cfg: ExperimentConfig) -> None:
    """Refuse, before anything starts, what the loop cannot run: the preflight's config rules
    (``moe-rl config validate``; the CLI also runs its machine rules). For library callers."""
    from moe_rl.config.preflight import config_problems

    config_problems(cfg).raise_if_any(f"config {cfg.name!r}")


def records_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}.safetensors"


class RLTrainer:
    """One experiment's learner, replay driver, task and sinks; ``run()`` drives the steps."""

    def __init__(self, cfg: ExperimentConfig):
        from moe_rl.learner.checkpoint import load_checkpoint
        from moe_rl.learner.dist import init_distributed
        from moe_rl.learner.train_step import Learner
        from moe_rl.replay.driver import ReplayDriver
        from moe_rl.train.run_dir import guard_run_dir

        check_supported(cfg)
        self.cfg = cfg
        self.run_dir = Path(cfg.train.output_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.records_dir = Path(cfg.train.rollouts_from) if cfg.train.rollouts_from else self.run_dir / ROLLOUTS_DIR
        init_distributed(cfg.parallel)
        self.is_main = is_main_process()
        # lock, writable paths, resume rules: before anything is written (rank 0 decides, all ranks follow)
        self.run_lock = guard_run_dir(cfg, self.run_dir, self.ckpt_dir, torch.distributed.get_rank())
        self.learner = Learner(cfg)  # imports checkpoint.init_from_hf when set
        meta = load_checkpoint(self.learner, self.ckpt_dir) if cfg.checkpoint.resume == "auto" else None
        self.start_step = int(meta["extra"]["rl_step"]) if meta else 0
        self.run_id = resolve_run_id(self.run_dir, resumed=meta is not None)  # same id on every rank
        self.version_nonce = version_nonce(self.run_id)  # weight-version labels step-<s>-<nonce>
        if self.is_main:  # only now is the run known to start (a model-shape change failed above)
            save_config(cfg, self.run_dir / "config.yaml")
            write_run_id(self.run_dir, self.run_id)
            write_checkpoint_identity(self.ckpt_dir, self.run_id, self.run_dir)  # whose checkpoints these are
        self.server_keys, self.server_pool = None, None  # set by run(): auth (a generated key by default), restarts
        self.weight_sync = None  # created at the first sync (its mode depends on the servers' hosts)
        if meta is None:  # a fresh run starts from the cached supervised warm start (train.warm_start)
            from moe_rl.train.warm_start import apply_warm_start

            apply_warm_start(self.learner, cfg)
        self.driver = ReplayDriver.from_config(self.learner.module, cfg)
        self.records = StepRecords.for_trainer(cfg, self.run_id)  # loads check records against the model
        self.tokenizer = self.prompts = self.rewarder = self.samples = self.evaluator = None  # rank 0's (below)
        if self.is_main and not self.from_records:
            self._prompt_data(meta)
        self.logprob_fn = make_logprob_fn(ksm_active(cfg), with_entropy=cfg.loss.entropy_coef > 0)
        self.device = next(self.learner.model.parameters()).device
        self.reference = self._reference_policy(meta is not None) if cfg.loss.kl_coef else None
        self._reference_saved = False  # save_reference checks the marker itself (rank 0) the first time
        self.plan(self.start_step)  # an impossible split fails here, before any server starts

    def _prompt_data(self, meta: dict | None) -> None:
        """The tokenizer, the prompt stream (at the checkpoint's dataset position) and the reward scorer."""
        from moe_rl.data import build_prompt_stream
        from moe_rl.data.chat import load_tokenizer
        from moe_rl.reward import build_rewarder

        self.tokenizer = load_tokenizer(self.cfg) if self.cfg.data is not None else None  # the built-in tasks: task ids
        self.prompts = build_prompt_stream(self.cfg, self.tokenizer)
        self.prompts.load_state((meta or {}).get("extra", {}).get("data"))
        self.rewarder = build_rewarder(self.cfg, self.tokenizer)
        self.samples = StepSamples(self.cfg, self.prompts, self.rewarder)
        if self.cfg.eval is not None:
            from moe_rl.train.evaluate import Evaluator

            self.evaluator = Evaluator(self.cfg, self.tokenizer, self.rewarder, self.prompts)

    def plan(self, step: int):
        """This rank's ``StepPlan`` for ``step``."""
        cfg = self.cfg
        dp_rank, dp_size = dp_rank_and_size()
        n = cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt
        return plan_step(n, minibatches=cfg.train.minibatches_per_step, micro_batch_size=cfg.train.micro_batch_size,
                         epochs=cfg.train.epochs_per_step, dp_rank=dp_rank, dp_size=dp_size, seed=cfg.train.seed,
                         step=step)  # fmt: skip

    def _reference_policy(self, resumed: bool):
        """π_ref for ``loss.kl_coef > 0``: the weights at the start of RL; on resume this run's saved
        reference or nothing (never rebuilt from the resumed weights). Rank 0 decides, all ranks follow."""
        from moe_rl.learner.dist import decided_by_rank0
        from moe_rl.learner.reference import ReferencePolicy, reference_problem
        from moe_rl.train.run_dir import RunDirError

        offload = torch.cuda.is_available()
        if not resumed:
            return ReferencePolicy.from_learner(self.cfg, self.learner.module, offload=offload)
        problem = decided_by_rank0(lambda: reference_problem(self.ckpt_dir, self.run_id))
        if problem is not None:
            raise RunDirError(
                f"cannot resume checkpoint.dir={self.ckpt_dir} with loss.kl_coef={self.cfg.loss.kl_coef}: {problem}. "
                "The KL anchor is the policy at the start of RL and is not rebuilt from trained weights; start "
                "over with checkpoint.resume=never checkpoint.overwrite=true (or set loss.kl_coef=0)"
            )
        return ReferencePolicy.load(self.cfg, self.ckpt_dir, offload=offload)

    @property
    def from_records(self) -> bool:
        return bool(self.cfg.train.rollouts_from)

    def _stop_tokens(self) -> dict:
        """Dataset prompts: responses end at the tokenizer's EOS ids (the built-in tasks: the server's default)."""
        from moe_rl.data.chat import stop_token_ids

        return {"stop_token_ids": stop_token_ids(self.tokenizer, self.cfg.model.hf_path)} if self.tokenizer else {}

    # ------------------------------------------------------------------ weights
    def export_weights(self) -> Path:
        """Export the learner as an HF dir for SGLang (collective); path of the live copy."""
        from moe_rl.learner.hf_convert import export_hf_checkpoint
        from moe_rl.rollout.quantize import quantize_hf_dir

        out = self.run_dir / "hf" / "current"
        export_hf_checkpoint(self.learner.module, self.cfg.model, out, template_dir=side_files_dir(self.cfg))
        if self.is_main and self.cfg.rollout.weight_quantization != "none":
            quantize_hf_dir(out, self.cfg.rollout.weight_quantization)
        barrier()
        return out

    def version(self, step: int) -> str:
        """The weight-version label of ``step``: ``step-<step>-<nonce>`` (the nonce derived from the run id)."""
        from moe_rl.rollout.integrity import version_label

        return version_label(step, self.version_nonce)

    def sync_weights(self, addresses: list[str], step: int) -> float:
        """Export (collective) and load the learner into every server as ``version(step)``: tensors through
        shared memory for servers on this host, an HF checkpoint on disk otherwise (``rollout.weight_sync``)."""
        from moe_rl.rollout.weights import WeightSync

        if self.from_records:
            return 0.0
        if self.weight_sync is None:
            self.weight_sync = WeightSync.from_config(self.cfg, addresses, export_dir=self.run_dir / "hf" / "current",
                                                      keys=self.server_keys)  # fmt: skip
        return self.weight_sync.sync(self.learner.module, addresses if self.is_main else [], self.version(step))

    def resync(self, addresses: list[str], step: int) -> None:
        """Push the served weights again as ``version(step)`` (rank 0, after a restart or a version mismatch)."""
        from moe_rl.rollout.weights import update_weights_from_disk

        ws = self.weight_sync
        if ws is not None and ws.last_state is not None:
            ws.close()  # distributed: a restarted server lost its group; the full sync rendezvouses again
            ws.push(ws.last_state, addresses, self.version(step))  # a full sync: clears any half-updated state
            return
        update_weights_from_disk(addresses, self.run_dir / "hf" / "current", self.version(step), keys=self.server_keys)

    # ------------------------------------------------------------------ one step
    def rollout(self, client, step: int) -> RolloutBatch:
        """This step's batch: generated, scored and persisted by rank 0 (or read from saved records)."""
        from moe_rl.rollout.integrity import generate_checked

        path = records_path(self.records_dir, step)
        if self.from_records:
            if not path.is_file():
                raise FileNotFoundError(f"train.rollouts_from={self.cfg.train.rollouts_from}: no records for step {step} "
                                        f"(expected {path})")  # fmt: skip
            return self.records.load(path)
        if self.is_main:
            from moe_rl.train.step_samples import round_group_ids

            n = self.cfg.rollout.samples_per_prompt
            if self.weight_sync is not None:
                self.weight_sync.check_servable(client.addresses)  # never sample a half-updated server

            def generate(prompts, round_):
                ids, groups = [p.ids for p in prompts], round_group_ids(round_, len(prompts))
                return generate_checked(  # the synced weight version only; a dead server we launched restarts
                    lambda: client.generate(ids, n, step=step, group_ids=groups), self.version(step),
                    resync=lambda: self.resync(client.addresses, step),
                    restart=self.server_pool.restart if self.server_pool else None,
                )  # fmt: skip

            samples, sample_metrics = self.samples.make(step, generate)
            batch = self.records.stamp(RolloutBatch.from_samples(samples, num_experts=self.cfg.model.num_moe_experts))
            if sample_metrics:
                batch.extra["reward_metrics"] = sample_metrics  # travels with the records to every rank
            batch.validate(self.cfg.model)
            batch.save(path)  # persisted before it is trained on
        barrier()
        return self.records.load(path)  # every rank: the bytes rank 0 wrote, checked against the model

    def step(self, client, step: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        batch = self.rollout(client, step)
        t_rollout = time.perf_counter() - t0
        if ksm_active(cfg):
            check_ksm_records(batch)
        rewards = torch.from_numpy(batch.rewards).double()
        plan = self.plan(step)
        if plan.num_samples != len(batch):
            raise RecordError(f"{self.records_dir}: step {step} has {len(batch)} samples; the config asks for "
                              f"{plan.num_samples} (train.prompts_per_step x rollout.samples_per_prompt)")  # fmt: skip
        truncated = torch.tensor([f == "length" for f in batch.finish_reasons], dtype=torch.bool)
        inputs = StepInputs(batch, torch.zeros(len(batch), device="cpu"), int(batch.response_lens.max()), self.device, step,
                            cfg.train.seed, trainable=~truncated if cfg.train.mask_truncated else None)  # fmt: skip
        self.driver.begin_step()
        t1 = time.perf_counter()
        old = ref = None
        if cfg.correction.mode == "decoupled":
            old = old_logprob_rows(cfg, self.learner, self.driver, self.logprob_fn, plan, inputs)
        if self.reference is not None:
            ref = reference_rows(cfg, self.reference, self.driver, self.logprob_fn, plan, inputs)
        t_old = time.perf_counter() - t1
        inputs.advantages = self.advantages(batch, rewards, old, inputs.width)
        t2 = time.perf_counter()
        results = [update_minibatch(cfg, self.learner, self.driver, self.logprob_fn, mb, inputs, old, ref, epoch)
                   for epoch, mb in plan.updates()]  # fmt: skip
        t_train = time.perf_counter() - t2
        metrics = _mean([r.metrics | {"train/loss": r.loss, "train/grad_norm": r.grad_norm, "train/lr": r.lr}
                         for r in results])  # fmt: skip
        metrics |= self.driver.step_metrics(group=dp_group())
        metrics |= batch.extra.get("reward_metrics", {})  # reward/errors, reward/<key> of a reward function
        metrics |= {
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()), "reward/max": float(rewards.max()),
            "response/len_mean": float(batch.response_lens.mean()),
            "response/len_max": float(batch.response_lens.max()),
            "response/truncated_frac": float(truncated.double().mean()),
            "response/masked_truncated": float(truncated.sum()) if cfg.train.mask_truncated else 0.0,
            "ksm/outside_mask_frac": kept_set_outside_fraction(batch) if ksm_active(cfg) else 0.0,
            **self.records.step_metrics(batch),
            "time/rollout_s": t_rollout, "time/old_logp_s": t_old, "time/train_s": t_train,
            "rollout/tokens_per_s": float(batch.response_lens.sum()) / max(t_rollout, 1e-9),
        }  # fmt: skip
        return metrics

    def _save_reference(self) -> None:
        """The reference weights, with this run's completion marker, before the first checkpoint (once)."""
        from moe_rl.learner.reference import save_reference

        if self.reference is not None and not self._reference_saved:
            save_reference(self.reference, self.ckpt_dir, self.run_id)
            self._reference_saved = True

    def advantages(self, batch: RolloutBatch, rewards: torch.Tensor, old: torch.Tensor | None, width: int):
        """Per-sample advantages ``[N]``; VCPO's baseline reads π_old (or μ in bypass mode)."""
        from moe_rl.algo import compute_advantages
        from moe_rl.algo.advantages import logit_grad_sq_norm
        from moe_rl.train.batching import response_row_mask, response_rows

        cfg, ids = self.cfg, list(range(len(batch)))
        extra = {"lengths": torch.as_tensor(batch.response_lens.astype("int64"), device="cpu")}
        if cfg.advantage.estimator == "vcpo_opob":
            mask = response_row_mask(batch, ids, width)
            mu = response_rows(batch, ids, width, kept_logp=ksm_active(cfg))
            src = mu if old is None else old.cpu()
            extra["is_weights"] = torch.exp(((src - mu) * mask).sum(1).clamp(-20, 20)).double()
            extra["grad_sq_norms"] = logit_grad_sq_norm(src, mask).double()
        return compute_advantages(cfg.advantage, rewards, cfg.rollout.samples_per_prompt, **extra).float()

    # ------------------------------------------------------------------ loop
    def _servers(self):
        """Rank 0's server pool (restartable), or an empty one (other ranks, records-replay mode)."""
        from moe_rl.rollout.launcher import ServerPool, rollout_server_pool

        if self.from_records or not self.is_main:
            return contextlib.nullcontext(ServerPool())
        return rollout_server_pool(self.cfg.rollout, self.export_weights(), self.run_dir / "logs", keys=self.server_keys)

    def run(self) -> Path:
        from moe_rl.learner.checkpoint import save_checkpoint
        from moe_rl.rollout.auth import ServerKeys
        from moe_rl.rollout.client import RolloutClient
        from moe_rl.train.run_dir import run_complete_message

        cfg = self.cfg
        if (done := run_complete_message(self.start_step, cfg.train.steps)) is not None:
            if self.is_main:
                print(done, flush=True)
            self.close()
            return self.run_dir
        logger = MetricsLogger(self.run_dir, cfg.logging, cfg.train.steps, self.start_step, self.is_main, cfg.name,
                               run_id=self.run_id)  # fmt: skip
        # the configured key variables (an unset one fails before any server), else a fresh admin key for the
        # servers this run launches (docs/operations.md); held in memory, handed to the servers' environment
        self.server_keys = ServerKeys.for_run(cfg.rollout)
        if not self.from_records and not self.is_main:
            self.export_weights()  # the export is collective; rank 0 runs it inside _servers()
        try:
            with self._servers() as self.server_pool:
                addresses = self.server_pool.addresses
                if self.is_main and not self.from_records:  # label the served weights with our version
                    self.resync(addresses, self.start_step)
                client = None
                if self.is_main and not self.from_records:
                    # the API key (a generated one by default); dataset prompts stop at the tokenizer's EOS
                    client = RolloutClient.from_config(cfg, addresses, headers=self.server_keys.headers(),
                                                       **self._stop_tokens())  # fmt: skip
                if self.start_step == 0 and self._eval_due(0):  # before the first step: a line of its own
                    logger.log(0, self.evaluator.run(client, 0, self.version(0)), progress=False)
                for step in range(self.start_step, cfg.train.steps):
                    t0 = time.perf_counter()
                    metrics = self.step(client, step)
                    metrics["time/sync_s"] = self.sync_weights(addresses, step + 1)
                    metrics["time/step_s"] = time.perf_counter() - t0
                    if self._eval_due(step + 1):  # at the weights just synced; never writes training records
                        t1 = time.perf_counter()
                        metrics |= self.evaluator.run(client, step + 1, self.version(step + 1))
                        metrics["time/eval_s"] = time.perf_counter() - t1
                    # log before checkpointing: a kill in between resumes from the older checkpoint,
                    # which cuts this line again, so no step's metrics can go missing
                    logger.log(step + 1, metrics)
                    if cfg.checkpoint.save_interval and (step + 1) % cfg.checkpoint.save_interval == 0 \
                            or step + 1 == cfg.train.steps:  # fmt: skip
                        self._save_reference()  # first: no checkpoint exists without its reference
                        save_checkpoint(self.learner, self.ckpt_dir, cfg.checkpoint.keep_last,
                                        extra=self._checkpoint_extra(step + 1), step=step + 1)  # dirs named by RL step
                if self.weight_sync is not None and self.weight_sync.mode != "disk":
                    self.export_weights()  # <run>/hf/current holds the final weights whatever the sync path
        finally:
            logger.close()
            self.close()
        return self.run_dir

    def _eval_due(self, step: int) -> bool:
        """Rank 0 evaluates after ``step`` RL steps (``eval`` section; generation needs the servers)."""
        return self.evaluator is not None and self.evaluator.due(step)

    def _checkpoint_extra(self, rl_step: int) -> dict:
        """What a checkpoint carries besides weights: the RL step and the dataset position (rank 0's)."""
        state = self.prompts.state() if self.prompts is not None else None
        return {"rl_step": rl_step} | ({"data": state} if state is not None else {})

    def close(self) -> None:
        """Release the routers (nothing stays bound after a run), the reward workers and the run directory's lock.

        ``run`` does it itself; callers driving the trainer by hand (``moe-rl diagnose``) call it.
        """
        self.driver.close()
        if self.weight_sync is not None:
            self.weight_sync.close()  # distributed: the weight-update group, on the servers and here
        if self.rewarder is not None:
            self.rewarder.close()
        if self.run_lock is not None:
            self.run_lock.release()


def _mean(records: list[dict]) -> dict[str, float]:
    keys = sorted({k for r in records for k in r})
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in keys}


def train(cfg: ExperimentConfig) -> Path:
    """Run RL training for ``cfg``; returns the run directory (metrics.jsonl, rollouts/, checkpoints/)."""
    return RLTrainer(cfg).run()
