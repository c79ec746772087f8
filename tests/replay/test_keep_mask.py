"""Keep Sampling Mask vs a brute-force masked softmax (float64 numpy, one token at a time)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_rl.replay.keep_mask import KeptSets, keep_mask_logprobs


def _engine_kept_set(z: np.ndarray, top_k: int | None, top_p: float | None) -> np.ndarray | None:
    """Kept ids of one token the way a sampler truncates: top-k, then top-p on the renormalised rest."""
    if top_k is None and top_p is None:
        return None
    order = np.argsort(-z, kind="stable")
    if top_k is not None:
        order = order[:top_k]
    if top_p is not None:
        p = np.exp(z[order] - z[order].max())
        p /= p.sum()
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        n = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        order = order[: min(n, len(order))]
    return np.sort(order)


def _brute_logp(z: np.ndarray, y: int, kept: np.ndarray | None) -> float:
    allowed = np.zeros(len(z), dtype=bool)
    if kept is None:
        allowed[:] = True
    else:
        allowed[kept] = True
        allowed[y] = True
    m = z[allowed].max()
    return float(z[y] - (m + np.log(np.exp(z[allowed] - m).sum())))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 12),
    vocab=st.integers(2, 40),
    top_k=st.one_of(st.none(), st.integers(1, 40)),
    top_p=st.one_of(st.none(), st.floats(0.05, 1.0)),
    temperature=st.floats(0.3, 2.0),
    drop_sampled=st.floats(0.0, 1.0),
)
def test_keep_mask_matches_brute_force_masked_softmax(device, seed, n, vocab, top_k, top_p, temperature, drop_sampled):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, size=(n, vocab))
    z = logits / temperature
    rows, targets, expect_outside = [], [], []
    for i in range(n):
        kept = _engine_kept_set(z[i], None if top_k is None else min(top_k, vocab), top_p)
        y = int(rng.choice(kept)) if kept is not None else int(rng.integers(vocab))
        outside = False
        # the engine's mask may disagree with the sampler at the cutoff: the sampled token is missing
        if kept is not None and len(kept) > 1 and rng.random() < drop_sampled:
            kept = kept[kept != y]
            outside = True
        if kept is not None:
            kept = rng.permutation(kept)  # order inside a set must not matter
        rows.append(kept)
        targets.append(y)
        expect_outside.append(outside)
    out = keep_mask_logprobs(
        torch.tensor(logits, dtype=torch.float64, device=device),
        torch.tensor(targets, device=device),
        KeptSets.from_lists(rows, device=device),
        temperature=temperature,
    )
    expected = [
        _brute_logp(z[i], targets[i], None if rows[i] is None else np.append(rows[i], targets[i])) for i in range(n)
    ]
    # the learner must still renormalise over kept ∪ {y} for the disagreeing rows
    np.testing.assert_allclose(out.logp.cpu().numpy(), expected, rtol=0, atol=1e-5)
    assert out.outside_mask.tolist() == expect_outside


def test_no_truncation_equals_full_log_softmax(device):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 33, dtype=torch.float64, generator=g).to(device)
    y = torch.randint(0, 33, (7,), generator=g).to(device)
    ref = torch.log_softmax(logits / 0.7, -1).gather(1, y[:, None])[:, 0]
    for kept in (None, KeptSets.from_lists([None] * 7)):
        out = keep_mask_logprobs(logits, y, kept, temperature=0.7)
        torch.testing.assert_close(out.logp, ref, rtol=0, atol=1e-12)
        assert out.num_outside == 0


def test_hand_computed_two_token_set(device):
    # kept {0, 2} of logits [0, ln 3, ln 3]: p(2 | kept) = 3 / (1 + 3) -> log 0.75
    logits = torch.tensor([[0.0, np.log(3.0), np.log(3.0)]], device=device)
    out = keep_mask_logprobs(logits, torch.tensor([2], device=device), KeptSets.from_lists([[0, 2]], device=device))
    assert out.logp.item() == pytest.approx(np.log(0.75), abs=1e-6)


def test_duplicate_kept_ids_count_once(device):
    logits = torch.tensor([[1.0, 2.0, 0.5]], device=device)
    y = torch.tensor([1], device=device)
    a = keep_mask_logprobs(logits, y, KeptSets.from_lists([[0, 1, 1, 0]], device=device)).logp
    b = keep_mask_logprobs(logits, y, KeptSets.from_lists([[0, 1]], device=device)).logp
    torch.testing.assert_close(a, b)


def test_gradient_is_zero_outside_the_kept_set_and_matches_autograd_of_brute_force(device):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 10, dtype=torch.float64, generator=g).to(device).requires_grad_(True)
    kept = [[1, 4, 7], None, [2]]
    y = torch.tensor([4, 9, 2], device=device)
    keep_mask_logprobs(logits, y, KeptSets.from_lists(kept), temperature=1.3).logp.sum().backward()  # host sets
    mask = torch.zeros(3, 10, dtype=torch.bool, device=device)
    mask[0, [1, 4, 7]] = True
    mask[1] = True
    mask[2, 2] = True
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = torch.log_softmax((ref_logits / 1.3).masked_fill(~mask, float("-inf")), -1).gather(1, y[:, None])
    ref.sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-12)
    assert (logits.grad[~mask] == 0).all()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (
            {"logits": torch.zeros(2, 4), "targets": torch.tensor([0, 4]), "kept": None},
            "targets must be token ids in [0, 4)",
        ),
        ({"logits": torch.zeros(2, 4), "targets": torch.tensor([0]), "kept": None}, "targets must be [N]=2"),
        (
            {"logits": torch.zeros(2, 4), "targets": torch.tensor([0, 1]), "kept": KeptSets.from_lists([[0]])},
            "kept.offsets must be [N+1]=3",
        ),
        (
            {"logits": torch.zeros(2, 4), "targets": torch.tensor([0, 1]), "kept": KeptSets.from_lists([[0], [9]])},
            "kept.ids must be token ids in [0, 4)",
        ),
        ({"logits": torch.zeros(4), "targets": torch.tensor([0]), "kept": None}, "logits must be [N, V]"),
    ],
)
def test_bad_input_names_the_field(kwargs, needle):
    with pytest.raises(ValueError) as err:
        keep_mask_logprobs(**kwargs)
    assert needle in str(err.value)


def test_kept_sets_from_a_rollout_batch_slice():
    ids = np.array([9, 1, 2, 3, 4, 5], dtype=np.int32)
    offsets = np.array([0, 1, 3, 3, 6])  # token 2 untruncated
    sets = KeptSets.from_numpy(ids, offsets[1:])  # the last three tokens
    assert sets.ids.tolist() == [1, 2, 3, 4, 5] and sets.offsets.tolist() == [0, 2, 2, 5]
