"""Rank 0's samples for one RL step: prompts, generation rounds, rewards, shaping and group filters.

Owns what turns the prompt stream, the servers and the reward into a step's scored samples: one
generation round per call of ``generate_round`` (the loop supplies it: weight-version checks and
server restarts are the loop's), the reward of every sample with DAPO's overlong shaping
(``reward.overlong_buffer``, ``moe_rl.reward.shaping``) added before groups are judged, and DAPO
dynamic sampling (``train.filter_groups``, ``moe_rl.source.filters``). Without filters a step is one
round and consumes the random streams exactly as before (round 0 keeps today's prompt and sampling
seeds; later rounds use their own). A trajectory (``rollout.agent``) is scored on its last turn's generated
tokens, unless its agent loop set its own reward (``moe_rl.source.agent_batch``).

ReMax (``advantage.estimator: remax``): ``generate`` returns, after the round's sampled responses, one greedy
response per prompt (temperature 0; ``moe_rl.source.batch_maker``). It is scored with the run's reward and the
same overlong shaping, its reward becomes every sampled response's ``reward_baseline`` (the records'
``reward_baselines``, read by the estimator: A = r − b), and it is never trained on: it does not enter the
batch, the group filters or the reward metrics (``reward/greedy_mean`` is its own), as in verl's
``ray_trainer`` (``gen_max``: ``do_sample=False``, its reward summed into ``reward_baselines``).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from moe_rl.reward.shaping import overlong_penalties
from moe_rl.source.agent_batch import reward_ids
from moe_rl.source.filters import Collected, GroupRound, collect_groups

__all__ = ["StepSamples", "round_group_ids"]


def round_group_ids(round_: int, n_prompts: int) -> list[int] | None:
    """Group ids (they key the sampling seeds) of a round's prompts: None (0..n-1) for round 0."""
    return None if round_ == 0 else [round_ * n_prompts + i for i in range(n_prompts)]


class StepSamples:
    """Produces one step's scored samples from ``generate(prompts, round) -> samples``."""

    def __init__(self, cfg, prompts, rewarder):
        self.cfg, self.prompts, self.rewarder = cfg, prompts, rewarder
        self._scoring = threading.Lock()  # async: steps in flight score one at a time (the reward pool has one queue)
        self.greedy = cfg.advantage.estimator == "remax"  # generate adds one greedy response per prompt

    def _score(self, prompts, samples, per_prompt: int) -> tuple[np.ndarray, object, np.ndarray | None]:
        """``(rewards with overlong shaping, the scorer's result, the penalties or None)`` of ``samples``."""
        with self._scoring:
            scores = self.rewarder.score(
                [prompts[k // per_prompt] for k in range(len(samples))], [reward_ids(s) for s in samples]
            )
        rewards = np.asarray(scores.rewards, dtype=np.float64)
        for k, sample in enumerate(samples):  # an agent loop's own reward (rollout.agent) replaces the scored one
            if sample.agent_reward is not None:
                rewards[k] = sample.agent_reward
        ob, penalty = self.cfg.reward.overlong_buffer, None
        if ob is not None:
            penalty = overlong_penalties(
                [len(s.response_ids) for s in samples], self.cfg.rollout.max_new_tokens, ob.length, ob.penalty
            )
            rewards = rewards + penalty
        return rewards, scores, penalty

    def _round(self, step: int, round_: int, generate: Callable, metrics: dict, drawn=lambda: None) -> GroupRound:
        cfg, n = self.cfg, self.cfg.rollout.samples_per_prompt
        prompts = self.prompts.next_prompts(step, cfg.train.prompts_per_step, round=round_)
        drawn()
        samples = generate(prompts, round_)
        greedy = samples[len(prompts) * n :]  # ReMax: one greedy response per prompt after the sampled ones
        samples = samples[: len(prompts) * n]
        if len(greedy) != (len(prompts) if self.greedy else 0):
            raise RuntimeError(f"generate returned {len(greedy)} extra responses; expected {int(self.greedy)} a prompt")
        rewards, scores, penalty = self._score(prompts, samples, n)
        if penalty is not None:
            metrics["reward/overlong_penalty_mean"].append(float(penalty.mean()))
            metrics["reward/overlong_frac"].append(float((penalty < 0).mean()))
        for key, value in scores.metrics.items():
            metrics[key].append(value)
        if self.greedy:  # its reward is every sampled response's baseline; it is not trained on
            baselines = self._score(prompts, greedy, 1)[0]
            for k, sample in enumerate(samples):
                sample.reward_baseline = float(baselines[k // n])
            metrics["reward/greedy_mean"].append(float(baselines.mean()))
            metrics["response/greedy_len_mean"].append(float(np.mean([len(s.response_ids) for s in greedy])))
        if cfg.data is not None:  # rows without a label (a reward function declaring needs_label = False)
            metrics["reward/no_label"].append(float(sum(prompts[k // n].label is None for k in range(len(samples)))))
        for k, sample in enumerate(samples):
            sample.data_file, sample.data_row = prompts[k // n].file, prompts[k // n].row
        return GroupRound(prompts, samples, rewards.tolist())

    def make(self, step: int, generate: Callable, drawn: Callable[[], None] = lambda: None) -> tuple[list, dict]:
        """``(samples with .reward set, metrics)``: ``prompts_per_step`` groups of ``samples_per_prompt``.
        ``drawn()`` is called once the step takes no more prompts: after round 0's draw, or with dynamic sampling
        once its rounds are done (whether another round is needed is known only from the rewards)."""
        cfg, per_round = self.cfg, defaultdict(list)
        t = cfg.train
        if t.filter_groups:
            got = collect_groups(
                lambda r: self._round(step, r, generate, per_round),
                t.prompts_per_step,
                cfg.rollout.samples_per_prompt,
                t.max_generation_rounds,
                t.filter_groups_fallback,
            )
            drawn()
        else:
            one = self._round(step, 0, generate, per_round, drawn)
            got = Collected(one.prompts, one.samples, one.rewards, rounds=1)
        for sample, reward in zip(got.samples, got.rewards):
            sample.reward = float(reward)
        metrics = {k: float(np.mean(v)) for k, v in per_round.items()}
        return got.samples, metrics | (got.metrics() if t.filter_groups else {})
