"""A-3PO's saved forward: the learner's time per RL step with ``correction.prox_logp_method`` recompute vs loglinear.

One ``RLTrainer`` in records-replay mode (no server) trains the same saved steps under three settings, interleaved
over ``--rounds`` rounds (weights, optimizer and RNG reset before each, as tests/distributed/methods_worker.py):

- ``recompute``: decoupled mode's old-log-prob pass (one no-grad forward of the whole step);
- ``loglinear_prepass``: A-3PO with π_θ from a no-grad pre-pass of each minibatch, what every A-3PO step ran
  before π_prox moved into the update's forward (forced here by an M2PO budget no token exceeds, so the pre-pass
  runs and masks nothing);
- ``loglinear``: A-3PO with π_prox from each microbatch's update forward (no extra forward).

Prints, per setting, the median over rounds x steps of ``time/old_logp_s``, ``time/train_s``, their sum, the
process CPU seconds of the step (``time.process_time``: less sensitive to other processes than wall time on a
shared machine) and the no-grad forwards counted.
Usage: python bench/bench_a3po_forward.py --records RUN/rollouts [--config configs/cpu_midsize.yaml --steps 3
--rounds 3 --out /tmp/a3po_bench] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from moe_rl.config.loader import load_config
from moe_rl.train.loop import RLTrainer
from tests.distributed.methods_worker import Reset, count_forwards

SETTINGS = {
    "recompute": ["correction.prox_logp_method=recompute"],
    "loglinear_prepass": ["correction.prox_logp_method=loglinear", "correction.m2po_tau=1e6"],
    "loglinear": ["correction.prox_logp_method=loglinear"],
}
BASE = ["correction.kl_alarm=null", "correction.kl_alarm_factor=null", "checkpoint.save_interval=0"]
BASE += ["logging.tensorboard=false", "logging.progress=false"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=Path, required=True)
    ap.add_argument("--config", default="configs/cpu_midsize.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/a3po_bench"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    common = [*BASE, f"train.rollouts_from={args.records}", f"train.steps={args.steps}", *args.overrides]

    def config(name):
        return load_config(args.config, overrides=[*common, *SETTINGS[name], f"train.output_dir={args.out / name}"])

    trainer = RLTrainer(config("recompute"))
    reset, forwards = Reset(trainer), count_forwards(trainer.learner)
    rows: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name in SETTINGS:
            reset.apply(trainer, config(name))
            for step in range(args.steps):
                cpu, n = time.process_time(), forwards[0]
                row = trainer.step(None, step)
                rows[name].append(
                    {
                        "old_logp_s": row["time/old_logp_s"],
                        "train_s": row["time/train_s"],
                        "learner_s": row["time/old_logp_s"] + row["time/train_s"],
                        "cpu_s": time.process_time() - cpu,
                        "forwards": forwards[0] - n,
                        "loss": row["loss/total"],
                    }
                )
    trainer.close()
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
