"""Time the full off-policy correction + GSPO loss + diagnostics, and every loss, on ~1M tokens (CPU).

Prints one line per measured stage (median of --repeats after one warm-up).
Usage: python bench/bench_algo.py [--batch 256 --seq 4096 --repeats 5 --ragged] [--only-losses]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import torch

from moe_rl.algo import (
    LOSS_TYPES,
    LossInputs,
    chained_rejection_mask,
    compute_policy_loss,
    ess_lr_scale,
    gspo_loss,
    m2po_mask,
    metrics_to_floats,
    offpolicy_metrics,
    rejection_mask,
    sequence_icepop_weights,
    surrogate_loss,
    truncated_is_weights,
)
from moe_rl.config import LossConfig


def make_batch(b: int, t: int, ragged: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if ragged:
        lengths = torch.randint(t // 8, t + 1, (b,), generator=g)
        mask = torch.arange(t)[None, :] < lengths[:, None]
    else:
        mask = torch.ones(b, t, dtype=torch.bool)
    roll = -torch.rand(b, t, generator=g) * 3  # μ from the inference engine
    old = roll + 0.02 * torch.randn(b, t, generator=g)  # π_old: small engine mismatch
    logp = (old + 0.01 * torch.randn(b, t, generator=g)).requires_grad_(True)
    adv = torch.randn(b, generator=g)
    return logp, old, roll, adv, mask


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median (wall seconds, process CPU seconds) over ``repeats`` calls after one warm-up.

    CPU time is reported too because the shared 2-core machine is often oversubscribed:
    wall time then measures the neighbours as much as this code.
    """
    fn()  # warm-up
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ragged", action="store_true", help="random lengths in [T/8, T] instead of a full mask")
    p.add_argument(
        "--only-losses", action="store_true", help="time only each loss.type's fwd+bwd and the new corrections"
    )
    args = p.parse_args()

    logp, old, roll, adv, mask = make_batch(args.batch, args.seq, args.ragged)
    n_tok = int(mask.sum())
    corr = SimpleNamespace(
        mode="decoupled",
        is_level="token",
        is_threshold=2.0,
        is_batch_normalize=True,
        rs_mode="seq_mean_k3",
        rs_lower=None,
        rs_upper=0.01,
        icepop=False,
        icepop_low=0.5,
        icepop_high=5.0,
        icepop_weighted=True,
        token_veto_threshold=1e-4,
        opsm_delta=1e-3,
    )
    loss_cfg = SimpleNamespace(
        type="gspo",
        clip_low=3e-4,
        clip_high=4e-4,
        dual_clip_c=None,
        aggregation="seq_mean_token_mean",
        kl_coef=0.0,
        kl_estimator="k3",
        entropy_coef=0.0,
    )

    def full_fwd():
        loss, m = compute_policy_loss(loss_cfg, corr, logp, old, roll, adv, mask)
        metrics_to_floats(m)
        return loss

    def full_fwd_bwd():
        logp.grad = None
        full_fwd().backward()

    def loss_stage(loss_type):
        cfg = LossConfig(type=loss_type)
        adv_tok = adv[:, None].expand_as(mask)
        gen = torch.Generator().manual_seed(0)

        def run():
            logp.grad = None
            loss, m = surrogate_loss(cfg, LossInputs(logp, old, adv_tok, mask, generator=gen))
            loss.backward()
            metrics_to_floats(m)

        return run

    criteria = [{"mode": "seq_mean_k3", "upper": 0.01}, {"mode": "token_k1", "lower": 0.5, "upper": 2.0}]
    seq_lw = torch.where(mask, old - roll, torch.zeros(())).sum(1)
    new_stages = {f"{t} fwd+bwd (surrogate_loss)": loss_stage(t) for t in LOSS_TYPES}
    new_stages |= {
        "m2po_mask(tau=0.04)": lambda: m2po_mask(logp, old, mask, 0.04),
        "chained_rejection_mask(seq_mean_k3 & token_k1)": lambda: chained_rejection_mask(old, roll, mask, criteria),
        "sequence_icepop_weights": lambda: sequence_icepop_weights(old, roll, mask, 0.5, 5.0),
        "ess_lr_scale (VCPO)": lambda: ess_lr_scale(seq_lw),
    }
    stages = (
        {}
        if args.only_losses
        else {
            "offpolicy_metrics": lambda: offpolicy_metrics(old, roll, mask),
            "truncated_is_weights(token, batch-norm)": lambda: truncated_is_weights(
                old, roll, mask, "token", 2.0, True
            ),
            "rejection_mask(seq_mean_k3)": lambda: rejection_mask(old, roll, mask, "seq_mean_k3", None, 0.01),
            "gspo_loss fwd+bwd": lambda: gspo_loss(LossInputs(logp, old, adv, mask))[0].backward(),
            "compute_policy_loss fwd (all corrections + GSPO + metrics)": full_fwd,
            "compute_policy_loss fwd+bwd": full_fwd_bwd,
        }
    )
    stages |= new_stages
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={args.batch} T={args.seq} "
        f"valid tokens {n_tok:,} ({'ragged' if args.ragged else 'full mask'}), float32"
    )
    print(f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    print(f"{'stage':<62} {'wall ms':>9} {'cpu ms':>9} {'M tok/s (wall)':>15}")
    for name, fn in stages.items():
        wall, cpu = timed(fn, args.repeats)
        print(f"{name:<62} {wall * 1e3:9.1f} {cpu * 1e3:9.1f} {n_tok / wall / 1e6:15.2f}")


if __name__ == "__main__":
    main()
