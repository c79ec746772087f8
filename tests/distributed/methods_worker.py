"""torchrun worker (1 or 2 ranks, gloo): one training step of every method from the same saved records and weights.

Run: ``torchrun --nproc_per_node=N tests/distributed/methods_worker.py --work DIR --records RECORDS --hf HF
--micro-batch-size M``. One ``RLTrainer`` (records-replay mode, no server) is built once; per method of
``methods_table.methods()`` its config replaces the trainer's, the weights, buffers, optimizer, step counter
and RNG go back to the state after the build, the replay driver, KL alarm, log-prob function and π_ref are
rebuilt from the method's config, and ``RLTrainer.step`` trains step 1 (the old-log-prob pass, advantages,
``train.minibatches_per_step`` updates; ``STEP_OF`` names methods that train another step). A method the preflight refuses is not run; its message is kept.
``--also NAME@microN...`` runs method NAME once more at micro_batch_size N (its row is ``NAME@microN``).
The first method runs again at the end (``repeat``): the reset must give the same numbers bit for bit.
Rank 0 writes ``DIR/result.json``: ``{"metrics": {method: row}, "refused": {method: message}, "repeat": row,
"seconds": {method: s}, "forwards": {method: n}}``, rows without the per-run timings; ``forwards`` counts the
step's no-grad forward passes (``learner.forward_logprobs`` calls: the old-log-prob pass, the pre-passes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from moe_rl.learner.optimizer import build_optimizer
from moe_rl.preflight import config_problems
from moe_rl.replay.driver import ReplayDriver
from moe_rl.train.kl_alarm import KLAlarm
from moe_rl.train.logprob import make_logprob_fn
from moe_rl.train.loop import RLTrainer
from moe_rl.train.run_dir import reference_policy
from tests.distributed.methods_table import STEP_OF, method_config, methods

VOLATILE = ("time/", "rollout/tokens_per_s")


class Reset:
    """The trainer's learner state right after the build, put back before each method."""

    def __init__(self, trainer: RLTrainer) -> None:
        module = trainer.learner.module
        self.tensors = {k: v.detach().clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}
        self.rng = torch.get_rng_state()

    def apply(self, trainer: RLTrainer, cfg) -> None:
        learner = trainer.learner
        with torch.no_grad():
            for k, v in learner.module.state_dict().items():
                if k in self.tensors:
                    v.copy_(self.tensors[k])
        learner.cfg = cfg
        learner.optimizer = build_optimizer(learner.model, cfg.optim, learner.config.params_dtype)
        learner.step = 0
        torch.set_rng_state(self.rng)
        trainer.cfg = cfg
        trainer.driver.close()
        trainer.driver = ReplayDriver.from_config(learner.module, cfg)
        trainer.kl_alarm = KLAlarm.from_config(cfg.correction)
        trainer.logprob_fn = make_logprob_fn(cfg.ksm_active, with_entropy=cfg.loss.entropy_coef > 0)
        kl = cfg.loss.kl_coef
        trainer.reference = reference_policy(cfg, learner, trainer.ckpt_dir, trainer.run_id, False) if kl else None


def count_forwards(learner) -> list[int]:
    """Count ``learner.forward_logprobs`` calls (the real method runs) in the returned one-element list."""
    calls, real = [0], learner.forward_logprobs

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    learner.forward_logprobs = counted
    return calls


def one_step(trainer: RLTrainer, step: int = 0) -> dict[str, float]:
    row = trainer.step(None, step)
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--hf", type=Path, required=True)
    ap.add_argument("--micro-batch-size", type=int, required=True)
    ap.add_argument("--also", nargs="*", default=[], help="NAME@microN: method NAME again at micro_batch_size N")
    ap.add_argument("--only", nargs="*", default=None, help="these methods only (a local check)")
    args = ap.parse_args()
    names = args.only or list(methods())

    def config(name):
        method, _, micro = name.partition("@micro")
        return method_config(method, args.records, args.hf, args.work / "run", int(micro or args.micro_batch_size))

    trainer = RLTrainer(config(names[0]))  # initialises the process group (torchrun's env)
    reset = Reset(trainer)
    res: dict = {"metrics": {}, "refused": {}, "seconds": {}, "forwards": {}}
    forwards = count_forwards(trainer.learner)
    for name in [*names, *args.also, "repeat"]:
        cfg = config(names[0] if name == "repeat" else name)
        problems = config_problems(cfg).problems
        if problems:
            res["refused"][name] = "; ".join(problems)
            continue
        reset.apply(trainer, cfg)
        t0, n0 = time.perf_counter(), forwards[0]
        row = one_step(trainer, STEP_OF.get(name.partition("@")[0], 0))
        res["seconds"][name] = round(time.perf_counter() - t0, 3)
        res["forwards"][name] = forwards[0] - n0
        if name == "repeat":
            res["repeat"] = row
        else:
            res["metrics"][name] = row
    trainer.close()
    if dist.get_rank() == 0:
        tmp = args.work / "result.json.tmp"
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(args.work / "result.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
