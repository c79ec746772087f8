"""Golden tests for IcePop, truncated IS, the 11 rejection modes, token veto and OPSM.

Expected numbers are worked by hand (comments) or by a scalar Python loop over
``math`` that shares no code with moe_rl.algo.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.algo import RS_MODES, icepop_weights, opsm_mask, rejection_mask, token_veto, truncated_is_weights


def pair(ratios: list[list[float]], base: float = math.log(0.3)):
    """(old_logp, rollout_logp, mask) with π_old/μ = the given ratios; ragged rows are padded."""
    t = max(len(r) for r in ratios)
    mask = torch.tensor([[j < len(r) for j in range(t)] for r in ratios])
    rows = [[math.log(r[j]) if j < len(r) else 0.0 for j in range(t)] for r in ratios]
    log_rho = torch.tensor(rows, dtype=torch.float64)
    rollout = torch.full(mask.shape, base, dtype=torch.float64)
    return rollout + log_rho, rollout, mask


def test_icepop_weighted_keeps_ratio_inside_band_and_zeroes_outside():
    old, roll, mask = pair([[0.49, 0.51, 1.0, 4.99, 5.01]])
    w, m = icepop_weights(old, roll, mask, low=0.5, high=5.0, weighted=True)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.51, 1.0, 4.99, 0.0]], dtype=torch.float64))
    assert m["icepop/masked_frac"].item() == pytest.approx(2 / 5)
    assert m["icepop/masked_frac_low"].item() == pytest.approx(1 / 5)
    assert m["icepop/masked_frac_high"].item() == pytest.approx(1 / 5)


def test_icepop_unweighted_is_a_zero_one_mask():
    old, roll, mask = pair([[0.49, 0.51, 1.0, 4.99, 5.01]])
    w, _ = icepop_weights(old, roll, mask, weighted=False)
    assert w.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0]]


def test_icepop_ignores_padding_and_is_detached():
    old, roll, mask = pair([[1.0, 100.0], [1.0]])
    old.requires_grad_(True)
    w, m = icepop_weights(old, roll, mask)
    assert w[1, 1] == 0 and not w.requires_grad
    assert m["icepop/masked_frac"].item() == pytest.approx(1 / 3)  # the 100× token only


def test_token_tis_truncates_at_threshold():
    old, roll, mask = pair([[0.5, 1.5, 3.0]])
    w, m = truncated_is_weights(old, roll, mask, level="token", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0]], dtype=torch.float64))
    assert m["is/truncated_frac"].item() == pytest.approx(1 / 3)
    assert m["is/batch_norm_factor"].item() == 1.0


def test_token_tis_batch_normalisation_gives_mean_one_over_valid_tokens():
    old, roll, mask = pair([[0.5, 1.5, 3.0], [1.0]])
    w, m = truncated_is_weights(old, roll, mask, level="token", threshold=2.0, batch_normalize=True)
    # truncated weights 0.5, 1.5, 2.0, 1.0 → mean 1.25
    torch.testing.assert_close(w, torch.tensor([[0.4, 1.2, 1.6], [0.8, 0.0, 0.0]], dtype=torch.float64))
    assert m["is/batch_norm_factor"].item() == pytest.approx(1.25)


def test_sequence_tis_uses_product_of_ratios_broadcast_to_tokens():
    old, roll, mask = pair([[2.0, 0.75], [3.0]])
    w, m = truncated_is_weights(old, roll, mask, level="sequence", threshold=2.0)
    # Π = 1.5 (kept) and 3.0 (truncated to 2)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5], [2.0, 0.0]], dtype=torch.float64))
    assert m["is/truncated_frac"].item() == pytest.approx(1 / 2)


def test_sequence_tis_batch_normalisation_is_over_sequences():
    old, roll, mask = pair([[2.0, 0.75], [3.0]])
    w, _ = truncated_is_weights(old, roll, mask, level="sequence", threshold=2.0, batch_normalize=True)
    # per-sequence weights 1.5, 2.0 → mean 1.75 (a token mean would give 5/3 instead)
    torch.testing.assert_close(w, torch.tensor([[1.5 / 1.75, 1.5 / 1.75], [2.0 / 1.75, 0.0]], dtype=torch.float64))


def _reference_keep(ratios: list[list[float]], mode: str, lower: float | None, upper: float) -> list[list[bool]]:
    """Scalar re-statement of seed 000's RS table, one token at a time."""
    agg, est = mode.rsplit("_", 1)
    lower = 1 / upper if (est == "k1" and lower is None) else lower

    def d(r):
        x = math.log(r)
        return {"k1": x, "k2": 0.5 * x * x, "k3": r - x - 1}[est]

    def bad(stat):
        return not (math.log(lower) <= stat <= math.log(upper)) if est == "k1" else stat > upper

    out = []
    for row in ratios:
        ds = [d(r) for r in row]
        if agg == "token":
            out.append([not bad(x) for x in ds])
            continue
        stat = {"seq_sum": sum(ds), "seq_mean": sum(ds) / len(ds), "seq_max": max(ds)}[agg]
        out.append([not bad(stat)] * len(row))
    return out


RS_RATIOS = [[1.1, 1.1, 1.1, 1.1], [3.0, 0.9], [0.6, 1.0, 1.05], [1.0], [0.95, 1.3, 1.2, 0.7]]


K1_BOUNDS = [(None, 1.5), (0.8, 1.25), (0.5, 2.0), (None, 1.08)]  # ratio bounds
KD_BOUNDS = [(None, 0.01), (None, 0.05), (None, 0.2), (None, 1.0)]  # divergence thresholds


@pytest.mark.parametrize("mode", RS_MODES)
@pytest.mark.parametrize("case", range(4))
def test_rejection_modes_match_scalar_reference(mode, case):
    lower, upper = (K1_BOUNDS if mode.endswith("k1") else KD_BOUNDS)[case]
    bounds = (lower, upper)
    old, roll, mask = pair(RS_RATIOS)
    keep, m = rejection_mask(old, roll, mask, mode, lower, upper)
    expected = _reference_keep(RS_RATIOS, mode, lower, upper)
    got = [[bool(keep[i, j]) for j in range(len(r))] for i, r in enumerate(RS_RATIOS)]
    assert got == expected, f"{mode} bounds={bounds}"
    assert not bool((keep & ~mask).any()), "rejection must never add padding tokens"
    removed = sum(r.count(False) for r in expected) / sum(len(r) for r in RS_RATIOS)
    assert m["rs/masked_frac"].item() == pytest.approx(removed)


def test_length_trap_seq_sum_rejects_long_sequences_seq_mean_keeps_all():
    # seed 000 "The length trap": ρ_t = 1.1 → Π = 2.59 (10 tok), 117 (50), 13780 (100)
    old, roll, mask = pair([[1.1] * 10, [1.1] * 50, [1.1] * 100])
    keep_sum, _ = rejection_mask(old, roll, mask, "seq_sum_k1", upper=3.0)
    keep_mean, _ = rejection_mask(old, roll, mask, "seq_mean_k1", upper=3.0)
    assert keep_sum.any(dim=1).tolist() == [True, False, False]
    assert keep_mean.any(dim=1).tolist() == [True, True, True]
    # k3: d = 1.1 − ln 1.1 − 1 = 0.00469 per token → sums 0.047 / 0.234 / 0.469, mean 0.00469
    keep_sum3, _ = rejection_mask(old, roll, mask, "seq_sum_k3", upper=0.1)
    keep_mean3, _ = rejection_mask(old, roll, mask, "seq_mean_k3", upper=0.1)
    assert keep_sum3.any(dim=1).tolist() == [True, False, False]
    assert keep_mean3.any(dim=1).tolist() == [True, True, True]
    differ = (keep_sum ^ keep_mean).any(dim=1)
    assert differ.tolist() == [False, True, True]


def test_k1_lower_zero_means_no_lower_bound():
    old, roll, mask = pair([[1e-6], [1.0], [10.0]])
    keep, _ = rejection_mask(old, roll, mask, "token_k1", lower=0.0, upper=2.0)
    assert keep[:, 0].tolist() == [True, True, False]


def test_token_veto_rejects_whole_sequence_on_one_catastrophic_token():
    # 1e-30 is beyond the ±20 log clamp: the veto must still see it
    old, roll, mask = pair([[1.0, 1e-5, 1.0], [1.0, 1.0], [0.9, 1e-30], [1.0]])
    keep, m = token_veto(old, roll, mask, threshold=1e-4)
    assert keep.any(dim=1).tolist() == [False, True, False, True]
    assert m["veto/seq_masked_frac"].item() == pytest.approx(2 / 4)
    assert m["veto/token_frac"].item() == pytest.approx(2 / 8)


def test_token_veto_ignores_padding():
    old, roll, mask = pair([[1.0, 1.0], [1.0]])
    old[1, 1] = -1e4  # garbage in a padded slot
    keep, _ = token_veto(old, roll, mask, threshold=1e-4)
    assert keep.tolist() == mask.tolist()


def test_opsm_drops_only_negative_advantage_sequences_beyond_delta():
    # mean(log μ − log π) per sequence: ln 2 = 0.69, 0.69, 0.01, ln 2
    logp, roll, mask = pair([[0.5, 0.5], [0.5], [0.99], [0.5, 0.5, 0.5]])
    adv = torch.tensor([-1.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    keep, m = opsm_mask(logp, roll, mask, adv, delta=0.1)
    assert keep.any(dim=1).tolist() == [False, True, True, True]
    assert m["opsm/seq_masked_frac"].item() == pytest.approx(1 / 4)
    assert m["opsm/token_masked_frac"].item() == pytest.approx(2 / 7)


def test_opsm_reduces_token_advantages_to_sequence_mean():
    logp, roll, mask = pair([[0.5, 0.5]])
    adv = torch.tensor([[-3.0, 1.0]], dtype=torch.float64)  # mean −1 → negative
    keep, _ = opsm_mask(logp, roll, mask, adv, delta=0.1)
    assert not bool(keep.any())
