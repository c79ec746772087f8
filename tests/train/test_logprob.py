"""Keep Sampling Mask's entropy is over the kept set (plus the sampled token), like its log-prob."""

from __future__ import annotations

import torch

from moe_rl.replay.keep_mask import KeptSets
from moe_rl.train.logprob import kept_set_entropy


def _reference(logits, target, kept, temperature):
    """Entropy of the softmax restricted to ``kept ∪ {target}`` (or the full vocabulary), in float64."""
    z = logits.double() / temperature
    support = sorted(set(kept) | {target}) if kept else list(range(len(z)))
    p = torch.softmax(z[support], dim=0)
    return float(-(p * p.log()).sum())


def test_entropy_over_kept_sets_matches_a_direct_renormalised_softmax(device):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 11, generator=g) * 3).to(device).requires_grad_(True)
    targets = torch.tensor([3, 0, 7, 10], device=device)
    rows = [[1, 3, 5], None, [7], [2, 4, 6, 8]]  # row 3's sampled token is outside its set: kept anyway
    kept = KeptSets.from_lists(rows, device=device)
    got = kept_set_entropy(logits, targets, kept, temperature=0.7)
    want = [_reference(logits[i].detach().cpu(), int(targets[i]), rows[i], 0.7) for i in range(4)]
    torch.testing.assert_close(
        got.detach().cpu().double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )
    assert got[2].item() == 0.0  # a one-token support has no entropy
    got.sum().backward()
    assert logits.grad[0, [0, 2, 4]].abs().sum() == 0, "ids outside the kept set get no gradient"
    assert logits.grad[1].abs().sum() > 0
