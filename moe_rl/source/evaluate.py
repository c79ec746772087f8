"""Held-out evaluation during training (the ``eval`` section): reward mean, pass@1 and pass@k per eval set.

Owns the eval sets (each ``data.eval_files`` file, named by its stem; for the built-in digit tasks,
``eval.task_prompts`` prompts of ``train.task`` drawn from their own seeded stream, named ``task``),
their generation through the run's servers at the weights being trained (``eval.temperature``, 0 =
greedy; no routes, no sampling masks), scoring with the run's reward, and the metrics
``eval/<name>/reward_mean``, ``eval/<name>/pass@1`` and ``eval/<name>/pass@<k>`` (k =
``eval.samples_per_prompt``; a sample is correct when its reward >= ``eval.pass_threshold``), with the
unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1):
pass@k = E[1 - C(n - c, k) / C(n, k)] over prompts with n samples of which c are correct.

With ``rollout.agent`` every eval sample is a trajectory of the run's agent loop (its tools and limits, as in
training) scored like a training trajectory (``agent_batch.reward_ids``: the last turn's generated tokens, or the
loop's own reward), and ``eval/<name>/turns_mean`` and ``eval/<name>/tool_calls_mean`` say how it got there.

Evaluation never writes training records and changes no training random stream: its sampling seeds
are keyed by ``EVAL_STEP_BASE + step``. It is callable from outside the synchronous loop (an
asynchronous producer pauses and calls ``run`` at the version being trained).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

from moe_rl.data.dataset import load_prompt_items, reward_needs_label
from moe_rl.data.prompt import PromptItem
from moe_rl.rollout.client import RolloutClient
from moe_rl.source.agent_batch import AgentRollouts, agent_metrics, reward_ids
from moe_rl.sync.integrity import check_weight_versions

__all__ = ["EVAL_SALT", "EVAL_STEP_BASE", "Evaluator", "eval_due", "pass_at_k"]

EVAL_STEP_BASE = 1 << 30  # eval sampling seeds: sample_seed(rollout.seed, EVAL_STEP_BASE + step, prompt, sample)
EVAL_SALT = 0xE7A1  # the built-in tasks' held-out prompt stream: default_rng([train.seed, EVAL_SALT])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with ``n`` samples of which ``c`` are correct (``k <= n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def eval_due(cfg, step: int) -> bool:
    """An ``eval`` section evaluates after ``step`` RL steps (0: before the first)?"""
    interval = cfg.eval.interval
    return step == 0 or step == cfg.train.steps or bool(interval and step % interval == 0)


class Evaluator:
    """The eval sets of one run and ``run(client, step)`` -> metrics (rank 0 only)."""

    def __init__(self, cfg, tokenizer, rewarder, prompts=None, log=print):
        self.cfg, self.rewarder = cfg, rewarder
        self.sets = self._sets(tokenizer, prompts, log)
        self.agents = AgentRollouts(cfg) if cfg.rollout.agent else None  # trajectories of the run's agent loop

    def _sets(self, tokenizer, prompts, log) -> list[tuple[str, list]]:
        cfg, e = self.cfg, self.cfg.eval
        if cfg.data is not None:
            needs_label = reward_needs_label(cfg)
            return [
                (
                    Path(f).stem,
                    load_prompt_items([f], tokenizer, cfg, log=log, limit=e.max_prompts, needs_label=needs_label)[0],
                )
                for f in cfg.data.eval_files
            ]

        task = prompts.task  # the built-in task's stream (moe_rl.data.stream.TaskStream)
        rng = np.random.default_rng([cfg.train.seed, EVAL_SALT])
        drawn = task.sample_prompts(
            e.task_prompts if e.max_prompts is None else min(e.max_prompts, e.task_prompts), rng
        )
        return [
            ("task", [PromptItem(ids=p.ids, label=p.answer_text, data_source=task.name, task_prompt=p) for p in drawn])
        ]

    def due(self, step: int) -> bool:
        """Evaluate after ``step`` RL steps (0: before the first)?"""
        return eval_due(self.cfg, step)

    def client(self, train_client):
        """A client for ``train_client``'s servers sampling at ``eval.temperature``, asking for no routes or masks."""

        return RolloutClient.from_config(
            self.cfg,
            train_client.addresses,
            sampling=replace(train_client.sampling, temperature=self.cfg.eval.temperature),
            route_spec=None,
            return_sampling_mask=False,
            headers=train_client.headers,
            stop_token_ids=train_client.stop_token_ids,
        )

    def run(self, train_client, step: int, expected_version: str | None = None) -> dict[str, float]:
        """Generate, score and summarise every eval set at the served weights (after ``step`` RL steps)."""

        e, client, out = self.cfg.eval, self.client(train_client), {}
        k = e.samples_per_prompt
        for name, items in self.sets:
            if self.agents is None:
                samples = client.generate([p.ids for p in items], k, step=EVAL_STEP_BASE + step)
            else:
                counts: Counter = Counter()
                samples = self.agents.generate(client, items, EVAL_STEP_BASE + step, metrics=counts, n=k)
                agent = agent_metrics(counts)
                out[f"eval/{name}/turns_mean"] = agent["agent/turns_mean"]
                out[f"eval/{name}/tool_calls_mean"] = agent.get("agent/tool_calls", 0.0) / len(samples)
            if expected_version is not None:
                check_weight_versions([s.weight_version for s in samples], expected_version)
            scores = self.rewarder.score([items[i // k] for i in range(len(samples))], [reward_ids(s) for s in samples])
            rewards = np.asarray(scores.rewards, dtype=np.float64).reshape(len(items), k)
            for i, s in enumerate(samples):  # an agent loop's own reward replaces the scored one (as in training)
                if s.agent_reward is not None:
                    rewards[i // k, i % k] = s.agent_reward
            correct = (rewards >= e.pass_threshold).sum(axis=1)
            out[f"eval/{name}/reward_mean"] = float(rewards.mean())
            out[f"eval/{name}/pass@1"] = float(np.mean([pass_at_k(k, int(c), 1) for c in correct]))
            if k > 1:
                out[f"eval/{name}/pass@{k}"] = float(np.mean([pass_at_k(k, int(c), k) for c in correct]))
            out[f"eval/{name}/response_len_mean"] = float(np.mean([len(s.response_ids) for s in samples]))
        return out
