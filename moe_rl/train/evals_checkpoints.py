"""The run's evals and checkpoints after a step's push: when each is due, who runs it, what a checkpoint carries.

Owns ``RunEval`` (the ``eval`` section's schedule, rank 0 evaluating while the other ranks follow) and
``RunCheckpoints`` (interval / last step / agreed stop, the reference policy saved before the first checkpoint);
it never orders the step (``moe_rl.train.loop``) nor makes batches. What the trainer makes later (the batch source)
is given as a callable and asked for when needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from moe_rl.config import ExperimentConfig
from moe_rl.learner.checkpoint import save_checkpoint
from moe_rl.learner.reference import save_reference
from moe_rl.source.evaluate import eval_due
from moe_rl.train.stop_signal import StopRequest
from moe_rl.train.weight_push import WeightPusher

__all__ = ["RunCheckpoints", "RunEval"]


class RunEval:
    """``due(step)``, ``after(client, step)`` (every rank), ``evaluate(client, step)`` (rank 0)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        weights: WeightPusher,
        prompt_side,
        source: Callable[[], object | None] = lambda: None,
    ):
        """``prompt_side``: rank 0's prompts and eval sets in sync mode (None otherwise); ``source()``: rank 0's batch
        source (None before the trainer made it, and on the other ranks)."""
        self.cfg, self.weights, self.prompt_side, self._source = cfg, weights, prompt_side, source

    def due(self, step: int) -> bool:
        """Rank 0 evaluates after ``step`` RL steps (``eval`` section; generation needs the servers); every rank
        knows it (the others wait for it)."""
        return not self.cfg.train.rollouts_from and self.cfg.eval is not None and eval_due(self.cfg, step)

    def after(self, client, step: int) -> dict[str, float]:
        """Every rank, after the push of ``step``: the eval metrics if one is due (never writes training records).
        Rank 0 evaluates while the other ranks follow (async: the producer waits; a re-sync its batch in flight
        asks for runs first, on every rank); {} on the other ranks."""
        if not self.due(step):
            return {}
        t1 = time.perf_counter()
        metrics = self.weights.calls.on_rank0(lambda: self._evaluate_alone(client, step))
        return {} if metrics is None else metrics | {"time/eval_s": time.perf_counter() - t1}

    def _evaluate_alone(self, client, step: int) -> dict[str, float]:
        """Rank 0: the eval with the batch source held (async: the producer waits; eval sees version ``step``)."""
        with self._source().exclusive(serve=True):
            return self.evaluate(client, step)

    def evaluate(self, client, step: int) -> dict[str, float]:
        """The eval sets at version ``step`` (sync: here; async: by the rollout process)."""
        if self.prompt_side is None:
            return self._source().evaluate(step, self.weights.version(step))
        return self.prompt_side.evaluator.run(client, step, self.weights.version(step))


class RunCheckpoints:
    """``after(step)``: the checkpoint after ``step`` RL steps when one is due; True when the run stops there."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        learner,
        ckpt_dir: Path,
        run_id: str,
        reference,
        stop: StopRequest,
        prompt_side,
        source: Callable[[], object | None] = lambda: None,
    ):
        """``reference``: the KL reference policy (None without ``loss.kl_coef``); ``prompt_side``: rank 0's prompt
        stream in sync mode (None otherwise); ``source()``: rank 0's batch source (None before the trainer made it,
        and on the other ranks)."""
        self.cfg, self.learner, self.ckpt_dir, self.run_id = cfg, learner, ckpt_dir, run_id
        self.reference, self.stop, self.prompt_side, self._source = reference, stop, prompt_side, source
        self._reference_saved = False  # save_reference checks the marker itself (rank 0) the first time

    def save_reference(self) -> None:
        """The reference weights, with this run's completion marker, before the first checkpoint (once)."""

        if self.reference is not None and not self._reference_saved:
            save_reference(self.reference, self.ckpt_dir, self.run_id)
            self._reference_saved = True

    def after(self, step: int) -> bool:
        """Checkpoint after ``step`` RL steps when one is due, at the last step, or when every rank agrees to stop
        (SLURM's warning, ``launch.signal``); True when the run stops here (``stop.stopped_after``)."""
        cfg = self.cfg
        stopping = self.stop.agreed() and step < cfg.train.steps
        if (
            cfg.checkpoint.save_interval
            and step % cfg.checkpoint.save_interval == 0
            or step == cfg.train.steps
            or stopping
        ):
            self.save_reference()  # first: no checkpoint exists without its reference
            extra, files = self.contents(step)
            save_checkpoint(
                self.learner,
                self.ckpt_dir,
                cfg.checkpoint.keep_last,
                extra=extra,
                step=step,
                files=files,
                run_id=self.run_id,
            )  # dirs named by RL step; every file bound to this run and step
        if stopping:
            self.stop.stopped_after = step
        return stopping

    def contents(self, rl_step: int) -> tuple[dict, dict]:
        """``(extra, files)`` a checkpoint carries besides weights (rank 0's): the RL step, the dataset position
        and, from the batch source, finished-but-untrained records (async mode: the position before them)."""
        state = self.prompt_side.prompts.state() if self.prompt_side is not None else None
        extra = {"rl_step": rl_step} | ({"data": state} if state is not None else {})
        source = self._source()
        if source is None:
            return extra, {}
        more, files = source.checkpoint_state(rl_step)
        return extra | more, files
