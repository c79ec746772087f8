"""The RL loop: rollout -> rewards -> advantages -> plan -> old log-probs -> updates -> sync.

Owns the order of one RL step and its persistence (records before training, checkpoints,
metrics, exported weights); when an eval or a checkpoint is due and what a checkpoint carries is
``moe_rl.train.evals_checkpoints``, the names of a step's metrics ``moe_rl.train.step_metrics``, the
wiring of rank 0's batch source ``moe_rl.train.batch_source``. It holds no algorithm branches (``moe_rl.algo``), no routing
decisions (``moe_rl.replay.ReplayDriver``) and no grouping decisions: which samples go to
which rank, minibatch and microbatch is the step's ``StepPlan`` (``moe_rl.train.plan``), which
``moe_rl.train.update`` executes. Per step ``s`` (all seeded by ``(train.seed, s)``, so a resumed
run repeats an uninterrupted one):

1. rank 0 gets the step's records from its batch source (``moe_rl.source.producer``: made inline in
   sync mode, by a producer thread running up to ``train.max_staleness`` steps ahead in async mode;
   ``moe_rl.source.batch_maker``: prompts from the prompt stream, generation on SGLang with routes,
   masks and log-probs, rewards, ``<run>/rollouts/step_<s>.safetensors`` saved before anything trains
   on it); every rank loads its share of it (``StepRecords``: the file rank 0 wrote, the samples the
   step plan gives the rank, each chunk checked, checked against the model). With
   ``train.rollouts_from: DIR`` the records are read from ``DIR`` instead (no server);
2. the step plan; in decoupled mode the old-log-prob pass (not under A-3PO's interpolation; with Σ_v π_v²
   when the estimator reads it, which runs it in bypass mode too); the advantages;
3. ``minibatches_per_step`` optimizer steps (times ``epochs_per_step``) under the replay driver;
4. export HF weights, push them to every server (``moe_rl.train.weight_push``; in async mode once the
   batch in flight is done), checkpoint every K steps (with the producer's finished-but-untrained records).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from moe_rl.config import ExperimentConfig, save_config
from moe_rl.learner.checkpoint import load_checkpoint
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.train_step import Learner
from moe_rl.preflight import config_problems
from moe_rl.records import RecordError, RolloutBatch
from moe_rl.replay.driver import ReplayDriver
from moe_rl.rollout.auth import ServerKeys
from moe_rl.rollout.server_pool import ServerPool, rollout_server_pool
from moe_rl.sizing import startup_timeout
from moe_rl.source.batch_maker import records_path
from moe_rl.source.producer import InlineBatches, pending_records
from moe_rl.source.rollout_worker import PromptSide
from moe_rl.source.step_records import StepRecords
from moe_rl.train.batch_source import inline_batch_maker, spawn_rollout_process, sync_client
from moe_rl.train.batching import check_ksm_records, kept_set_outside_fraction
from moe_rl.train.collectives import dp_group, dp_rank_and_size, is_main_process, records_read_metrics
from moe_rl.train.evals_checkpoints import RunCheckpoints, RunEval
from moe_rl.train.kl_alarm import KLAlarm
from moe_rl.train.logprob import make_logprob_fn
from moe_rl.train.metrics_log import MetricsLogger
from moe_rl.train.plan import plan_step
from moe_rl.train.run_dir import guard_run_dir, reference_policy, run_complete_message
from moe_rl.train.run_identity import resolve_run_id, version_nonce, write_checkpoint_identity, write_run_id
from moe_rl.train.staleness import StepStaleness
from moe_rl.train.step_metrics import step_metrics
from moe_rl.train.stop_signal import StopRequest
from moe_rl.train.update import (
    StepInputs,
    needs_sum_pi_squared,
    old_logprob_rows,
    reference_rows,
    runs_old_logprob_pass,
    step_advantages,
    update_minibatch,
)
from moe_rl.train.warm_start import apply_warm_start
from moe_rl.train.weight_push import WeightPusher

__all__ = ["ROLLOUTS_DIR", "RLTrainer", "check_supported", "train"]

ROLLOUTS_DIR = "rollouts"


def check_supported(cfg: ExperimentConfig) -> None:
    """Refuse, before anything starts, what the loop cannot run: the preflight's config rules
    (``moe-rl config validate``; the CLI also runs its machine rules). For library callers."""
    config_problems(cfg).raise_if_any(f"config {cfg.name!r}")


class RLTrainer:
    """One experiment's learner, replay driver, task and sinks; ``run()`` drives the steps."""

    def __init__(self, cfg: ExperimentConfig, stop: StopRequest | None = None):
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
        self.resume_meta = meta or {}  # the async producer's pending records come from it
        self.source = None  # rank 0's batch source (moe_rl.source.producer), set by run()
        self.start_step = int(meta["extra"]["rl_step"]) if meta else 0
        self.run_id = resolve_run_id(self.run_dir, resumed=meta is not None)  # same id on every rank
        # the learner's exports, version labels step-<s>-<nonce> and pushes; it asks for what run() makes later
        self.weights = WeightPusher(
            cfg,
            self.learner,
            self.run_dir,
            version_nonce(self.run_id),
            self.is_main,
            keys=lambda: self.server_keys,
            revive=lambda: [] if self.server_pool is None else self.server_pool.restart(),  # rank 0: the dead servers
            source=lambda: self.source,
        )
        if self.is_main:  # only now is the run known to start (a model-shape change failed above)
            save_config(cfg, self.run_dir / "config.yaml")
            write_run_id(self.run_dir, self.run_id)
            write_checkpoint_identity(self.ckpt_dir, self.run_id, self.run_dir)  # whose checkpoints these are
        self.stop = StopRequest(None) if stop is None else stop  # train(): launch.signal's, armed (train.stop_signal)
        self.server_keys, self.server_pool = None, None  # set by run(): auth (a generated key by default), restarts
        if meta is None:  # a fresh run starts from the cached supervised warm start (train.warm_start)
            apply_warm_start(self.learner, cfg)
        self.driver = ReplayDriver.from_config(self.learner.module, cfg)
        self.records = StepRecords.for_trainer(cfg, self.run_id)  # loads check records against the model
        self.prompt_side = None  # rank 0's prompts, rewards and eval sets (sync; async: the rollout process's)
        data_state = (meta or {}).get("extra", {}).get("data")  # the checkpoint's prompt-stream position
        if self.is_main and not self.from_records and cfg.train.rollout_mode == "sync":
            self.prompt_side = PromptSide.build(cfg, data_state)
        self.logprob_fn = make_logprob_fn(cfg.ksm_active, with_entropy=cfg.loss.entropy_coef > 0)
        self.device = next(self.learner.model.parameters()).device
        self.reference = (
            reference_policy(cfg, self.learner, self.ckpt_dir, self.run_id, meta is not None)
            if cfg.loss.kl_coef
            else None
        )
        # after each push: the eval when due (rank 0, the others follow), the checkpoint when due
        self.evals = RunEval(cfg, self.weights, self.prompt_side, source=lambda: self.source)
        self.checkpoints = RunCheckpoints(
            cfg,
            self.learner,
            self.ckpt_dir,
            self.run_id,
            self.reference,
            self.stop,
            self.prompt_side,
            source=lambda: self.source,
        )
        self.kl_alarm = KLAlarm.from_config(cfg.correction)
        self.plan(self.start_step)  # an impossible split fails here, before any server starts
        if self.is_main and not self.from_records and cfg.train.rollout_mode == "async":
            # bad data or reward fails here, before any server
            self.source = spawn_rollout_process(cfg, self.run_id, self.weights.nonce, self.records_dir, data_state)

    def plan(self, step: int):
        """This rank's ``StepPlan`` for ``step``."""
        cfg = self.cfg
        dp_rank, dp_size = dp_rank_and_size()
        n = cfg.train.prompts_per_step * cfg.rollout.samples_per_prompt
        return plan_step(
            n,
            minibatches=cfg.train.minibatches_per_step,
            micro_batch_size=cfg.train.micro_batch_size,
            epochs=cfg.train.epochs_per_step,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=cfg.train.seed,
            step=step,
        )

    @property
    def from_records(self) -> bool:
        return bool(self.cfg.train.rollouts_from)

    # ------------------------------------------------------------------ one step
    def rollout(self, client, step: int, plan=None) -> RolloutBatch:
        """This step's batch: made on rank 0 by the batch source (or read from saved records), loaded everywhere:
        each data-parallel rank reads its ``plan``'s share of the samples (all of them without a plan)."""
        path = records_path(self.records_dir, step)
        share = {
            "share": None if plan is None else plan.owned_ids,
            "num_samples": None if plan is None else plan.num_samples,
        }
        if plan is not None:  # the per-token arrays every rank reads: μ (the one this config trains on) and versions
            share["shared"] = ("sampling_logp" if self.cfg.ksm_active else "rollout_logp", "token_versions")
        if self.from_records:
            if not path.is_file():
                raise FileNotFoundError(
                    f"train.rollouts_from={self.cfg.train.rollouts_from}: no records for step {step + 1} (expected {path})"
                )
            return self.records.load(path, **share)
        made = self.weights.calls.on_rank0(lambda: self._make_batch(client, step))  # a re-sync on the way runs on all
        return self.records.load(path if made is None else made, **share)  # every rank: rank 0's file, checked

    def _make_batch(self, client, step: int) -> Path:
        """Rank 0: the step's records from the batch source (made inline when the trainer is driven by hand)."""
        return (self.source or InlineBatches(self._batch_maker(client), step)).batch(step)

    def _batch_maker(self, client):
        return inline_batch_maker(
            self.cfg, self.prompt_side, self.records, self.records_dir, client, self.weights, self.server_pool
        )

    def _old_rows(self, plan, inputs):
        return old_logprob_rows(self.cfg, self.learner, self.driver, self.logprob_fn, plan, inputs)

    def step(self, client, step: int) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        plan = self.plan(step)
        batch = self.rollout(client, step, plan)
        t_rollout = time.perf_counter() - t0
        if cfg.ksm_active:
            check_ksm_records(batch)
        rewards = torch.from_numpy(batch.rewards).double()
        if plan.num_samples != len(batch):
            raise RecordError(
                f"{self.records_dir}: step {step + 1} has {len(batch)} samples; the config asks for "
                f"{plan.num_samples} (train.prompts_per_step x rollout.samples_per_prompt)"
            )
        if cfg.advantage.estimator == "remax" and batch.reward_baselines() is None:
            raise RecordError(
                f"{self.records_dir}: step {step + 1}'s records carry no reward_baselines (a greedy response's reward "
                "per prompt, made when advantage.estimator=remax generates them); expected records made with remax"
            )
        truncated = torch.tensor([f == "length" for f in batch.finish_reasons], dtype=torch.bool)
        width = int(batch.response_lens.max())
        stale = StepStaleness(
            batch, step, width, cfg.train.max_staleness if cfg.train.rollout_mode == "async" else None
        )
        inputs = StepInputs(
            batch,
            torch.zeros(len(batch), device="cpu"),
            width,
            self.device,
            step,
            cfg.train.seed,
            trainable=~truncated if cfg.train.mask_truncated else None,
            token_keep=stale.token_keep(cfg.correction.max_token_staleness),
            staleness=stale.rows if stale.known else None,
        )
        self.driver.begin_step()
        t1 = time.perf_counter()
        old = ref = scored = spp = None
        alarm_row: dict = {}
        if needs_sum_pi_squared(cfg):  # Σ_v π_v² from the same forwards (the token baselines, VCPO exact)
            scored, spp = old_logprob_rows(cfg, self.learner, self.driver, self.logprob_fn, plan, inputs, True)
        if runs_old_logprob_pass(cfg):  # decoupled, not A-3PO (its π_prox is interpolated per minibatch)
            old = scored if scored is not None else self._old_rows(plan, inputs)
        if self.kl_alarm.enabled:  # bypass mode: one forward pass at the current weights to measure it
            pi = old if old is not None else (scored if scored is not None else self._old_rows(plan, inputs))
            skip, alarm_row = self.kl_alarm.verdict(  # step + 1: the 1-based step of metrics.jsonl
                step + 1, batch, pi, width, cfg.ksm_active, inputs.staleness
            )
            if skip:  # not trained on: the row says why (alarm/*), not offpolicy/kl_k3
                return alarm_row | {"reward/mean": float(rewards.mean()), "time/rollout_s": t_rollout}
        if self.reference is not None:
            ref = reference_rows(cfg, self.reference, self.driver, self.logprob_fn, plan, inputs)
        t_old = time.perf_counter() - t1
        inputs.advantages = step_advantages(cfg, batch, rewards, old if spp is None else scored, inputs.width, spp)
        t2 = time.perf_counter()
        results = [
            update_minibatch(cfg, self.learner, self.driver, self.logprob_fn, mb, inputs, old, ref, epoch)
            for epoch, mb in plan.updates()
        ]
        t_train = time.perf_counter() - t2
        return step_metrics(
            cfg,
            batch,
            rewards,
            truncated,
            results,
            replay=self.driver.step_metrics(group=dp_group()),
            records=self.records.step_metrics(batch) | records_read_metrics(self.records.last_read, self.device),
            ksm_outside=kept_set_outside_fraction(batch, dp_group()) if cfg.ksm_active else 0.0,
            stale=stale.metrics(),
            alarm=alarm_row,
            times={"time/rollout_s": t_rollout, "time/old_logp_s": t_old, "time/train_s": t_train},
        )

    # ------------------------------------------------------------------ loop
    def _servers(self):
        """Rank 0's server pool (restartable), or an empty one (other ranks, records-replay mode)."""

        if self.from_records or not self.is_main:
            return contextlib.nullcontext(ServerPool())
        return rollout_server_pool(
            self.cfg.rollout,
            self.weights.export(),
            self.run_dir / "logs",
            keys=self.server_keys,
            startup_timeout_s=startup_timeout(self.cfg).value,  # derived from the bytes to load when unset
        )

    def run(self) -> Path:
        cfg = self.cfg
        if (done := run_complete_message(self.start_step, cfg.train.steps)) is not None:
            if self.is_main:
                print(done, flush=True)
            self.close()
            return self.run_dir
        logger = MetricsLogger(
            self.run_dir, cfg.logging, cfg.train.steps, self.start_step, self.is_main, cfg.name, run_id=self.run_id
        )
        # the configured key variables (an unset one fails before any server), else a fresh admin key for the
        # servers this run launches (docs/operations.md); held in memory, handed to the servers' environment
        self.server_keys = ServerKeys.for_run(cfg.rollout)
        if not self.from_records and not self.is_main:
            self.weights.export()  # the export is collective; rank 0 runs it inside _servers()
        try:
            with self._servers() as self.server_pool, self._source_scope():  # the producer stops before the servers
                addresses = self.server_pool.addresses
                client = self._open_source(addresses, logger)
                for step in range(self.start_step, cfg.train.steps):
                    t0 = time.perf_counter()
                    metrics = self.step(client, step)  # the batch (rank 0's, loaded on every rank) and the updates
                    metrics["time/sync_s"] = 0.0 if self.from_records else self.weights.push(addresses, step + 1)
                    metrics["time/step_s"] = time.perf_counter() - t0
                    metrics |= self.evals.after(client, step + 1)  # at the weights just pushed, if due
                    if self.source is not None:
                        metrics |= self.source.take_times()  # time/learner_wait_s, time/rollout_idle_s
                    # log before checkpointing: a kill in between resumes from the older checkpoint,
                    # which cuts this line again, so no step's metrics can go missing
                    logger.log(step + 1, metrics)
                    if self.checkpoints.after(step + 1):  # a stop request: the run ends at this checkpoint
                        break
                if self.stop.stopped_after is None:
                    self.weights.export_final()
        finally:
            logger.close()
            self.close()
        return self.run_dir

    @contextlib.contextmanager
    def _source_scope(self):
        try:
            yield
        finally:
            if self.source is not None:
                self.source.close()

    def _open_source(self, addresses: list[str], logger: MetricsLogger):
        """Rank 0 labels the served weights with our version and opens the batch source on the servers (sync: the
        client it returns, for the inline batches and eval); a fresh run evaluates before its first step, on a line
        of its own; then the producer starts."""
        client = None
        if self.is_main and not self.from_records:
            self.weights.resync(addresses, self.start_step)
            client = self._begin_source(addresses)
        if self.is_main and self.start_step == 0 and self.evals.due(0):
            logger.log(0, self.evals.evaluate(client, 0), progress=False)
        if self.source is not None:
            self.source.start()
        return client

    def _begin_source(self, addresses: list[str]):
        """Rank 0: the batch source meets the servers (a resumed checkpoint's pending records first); sync: the
        client, for the inline batches and eval (None in async mode: the rollout process has its own)."""

        pending = pending_records(self.resume_meta, self.records_dir)
        client = None
        if self.source is None:  # sync: the API key (a generated one by default); dataset prompts stop at EOS
            client = sync_client(self.cfg, addresses, self.server_keys, self.prompt_side)
            self.source = InlineBatches(self._batch_maker(client), self.start_step, pending)
        else:
            self.source.begin(
                addresses, self.server_keys, self.start_step, self.start_step, pending, self.weights, self.server_pool
            )
        return client

    def close(self) -> None:
        """Release the routers (nothing stays bound after a run), the reward workers and the run directory's lock.

        ``run`` does it itself; callers driving the trainer by hand (``moe-rl diagnose``) call it.
        """
        self.driver.close()
        if self.source is not None:
            self.source.close()
        self.weights.close()
        if self.prompt_side is not None:
            self.prompt_side.rewarder.close()
        if self.run_lock is not None:
            self.run_lock.release()


def train(cfg: ExperimentConfig, stop: StopRequest | None = None) -> Path:
    """Run RL training for ``cfg``; returns the run directory (metrics.jsonl, rollouts/, checkpoints/).

    ``stop`` (default: ``launch.signal``'s, armed here): its signal ends the run after the step in progress,
    with a checkpoint; ``stop.stopped_after`` then names that step."""
    stop = StopRequest.for_config(cfg) if stop is None else stop
    with stop.installed():
        return RLTrainer(cfg, stop).run()
