"""How stale a step's tokens are, and what that keeps out of the loss (host tensors, like the records).

Owns per-token staleness ``step - token_version`` (the records' ``token_versions``; older records: the
sample's version on every token; a trajectory's environment tokens have none and count nowhere), the async guard (a sample whose oldest token is more than
``train.max_staleness`` versions old is never trained on: kept out of the loss, counted in
``async/dropped_stale``), ``correction.max_token_staleness`` (tokens older than that are rejected like any
other rejection: out of the loss and its denominator) and the metrics ``async/staleness_mean``,
``async/staleness_max``, ``async/partial_frac`` (share of samples spanning more than one version) and
``offpolicy/kl_k3/staleness_<n>`` (KL k3 between μ and π_old, or π_θ in bypass, over the tokens ``n``
versions old).
"""

from __future__ import annotations

import numpy as np
import torch

from moe_rl.algo import LOG_RATIO_BOUND
from moe_rl.records import RolloutBatch
from moe_rl.records.versions import token_versions_of

__all__ = ["StepStaleness", "staleness_kl_metrics"]


class StepStaleness:
    """One step's token staleness as response rows, the samples the guard drops, and the batch metrics."""

    def __init__(self, batch: RolloutBatch, step: int, width: int, max_staleness: int | None):
        tv = token_versions_of(batch)
        self.known = tv is not None
        lens = batch.response_lens.astype(np.int64)
        self.rows = torch.zeros(len(batch), width, dtype=torch.int64, device="cpu")  # staleness per response position
        if self.known:
            stale = step - tv.astype(np.int64)
            ends = np.cumsum(lens)
            for i, (end, n) in enumerate(zip(ends, lens)):
                self.rows[i, :n] = torch.from_numpy(stale[end - n : end]).to("cpu")
        self.valid = valid = torch.arange(width, device="cpu")[None, :] < torch.from_numpy(lens).to("cpu")[:, None]
        if self.known and batch.role_mask is not None:  # environment tokens (version -1): no staleness
            gen = torch.zeros(len(batch), width, dtype=torch.bool, device="cpu")
            for i, (end, n) in enumerate(zip(np.cumsum(lens), lens)):
                gen[i, :n] = torch.from_numpy(batch.role_mask[end - n : end].astype(bool)).to("cpu")
            self.valid = valid = valid & gen
            self.rows = torch.where(gen, self.rows, torch.zeros_like(self.rows))
        oldest = torch.where(valid, self.rows, torch.zeros_like(self.rows)).amax(dim=1)
        self.dropped = (
            (oldest > max_staleness)
            if (self.known and max_staleness is not None)
            else torch.zeros(len(batch), dtype=torch.bool, device="cpu")
        )
        self.spans = torch.tensor(
            [bool((self.rows[i][valid[i]] != self.rows[i, 0]).any()) for i in range(len(lens))], device="cpu"
        )

    def token_keep(self, max_token_staleness: int | None) -> torch.Tensor | None:
        """``[N, R]`` bool: tokens the loss may see (guard and ``correction.max_token_staleness``); None = all."""
        keep = None
        if self.dropped.any():
            keep = ~self.dropped[:, None].expand_as(self.valid)
        if max_token_staleness is not None and self.known:
            fresh = self.rows <= max_token_staleness
            keep = fresh if keep is None else keep & fresh
        return keep

    def metrics(self) -> dict[str, float]:
        if not self.known:
            return {}
        tokens = self.rows[self.valid].double()
        return {
            "async/staleness_mean": float(tokens.mean()),
            "async/staleness_max": float(tokens.max()),
            "async/partial_frac": float(self.spans.double().mean()),
            "async/dropped_stale": float(self.dropped.sum()),
        }


@torch.no_grad()
def staleness_kl_metrics(source: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, stale: torch.Tensor) -> dict:
    """``offpolicy/kl_k3/staleness_<n>``: mean(ρ − log ρ − 1), log ρ = source − μ, over the tokens ``n`` old."""

    lr = (source - mu).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).double()
    k3 = torch.expm1(lr) - lr
    out = {}
    for n in torch.unique(stale[mask]).tolist():
        sel = mask & (stale == n)
        out[f"offpolicy/kl_k3/staleness_{int(n)}"] = float(k3[sel].mean())
    return out
