"""Token staleness from the records' ``token_versions``: the rows, the async guard, ``correction.max_token_staleness``,
the ``async/`` metrics and KL k3 per staleness (checked against numpy, not the code under test)."""

import numpy as np
import torch

from moe_rl.records import RolloutBatch, RolloutSample
from moe_rl.train.staleness import StepStaleness, staleness_kl_metrics


def _batch(samples) -> RolloutBatch:
    """``samples``: (label, token versions or None) per sample."""
    out = []
    for label, versions in samples:
        r = 3 if versions is None else len(versions)
        out.append(
            RolloutSample(
                prompt_ids=np.array([1], np.int32),
                response_ids=np.arange(2, 2 + r, dtype=np.int32),
                rollout_logp=np.full(r, -1.0, np.float32),
                weight_version=label,
                finish_reason="stop",
                token_versions=None if versions is None else np.asarray(versions, np.int32),
            )
        )
    return RolloutBatch.from_samples(out)


def test_rows_metrics_and_the_guard():
    batch = _batch([("step-5", [5, 5]), ("step-5", [3, 4, 5]), ("step-4", None)])
    st = StepStaleness(batch, step=5, width=3, max_staleness=1)
    assert st.rows.tolist() == [[0, 0, 0], [2, 1, 0], [1, 1, 1]]
    assert st.dropped.tolist() == [False, True, False]  # its oldest token is 2 versions old > k = 1
    m = st.metrics()
    assert m["async/staleness_max"] == 2 and m["async/dropped_stale"] == 1
    assert m["async/staleness_mean"] == (0 + 0 + 2 + 1 + 0 + 1 + 1 + 1) / 8
    assert m["async/partial_frac"] == 1 / 3
    keep = st.token_keep(None)
    assert keep.tolist() == [[True] * 3, [False] * 3, [True] * 3]
    keep = st.token_keep(0)  # max_token_staleness = 0 on top of the guard: only version-5 tokens
    assert keep[0, :2].tolist() == [True, True] and not keep[1].any() and not keep[2].any()


def test_sync_mode_has_no_guard_and_unknown_versions_no_metrics():
    st = StepStaleness(_batch([("step-2", [0, 1, 2])]), step=2, width=3, max_staleness=None)
    assert not st.dropped.any() and st.token_keep(None) is None
    unknown = StepStaleness(_batch([("hand-made", None)]), step=2, width=3, max_staleness=1)
    assert unknown.metrics() == {} and unknown.token_keep(0) is None


def test_kl_k3_per_staleness_matches_numpy():
    rng = np.random.default_rng(0)
    src, mu = rng.normal(-1, 0.3, (4, 5)), rng.normal(-1, 0.3, (4, 5))
    mask = rng.random((4, 5)) > 0.2
    stale = rng.integers(0, 3, (4, 5))
    got = staleness_kl_metrics(torch.tensor(src), torch.tensor(mu), torch.tensor(mask), torch.tensor(stale))
    for n in range(3):
        sel = mask & (stale == n)
        rho = np.exp(src[sel] - mu[sel])
        assert np.isclose(got[f"offpolicy/kl_k3/staleness_{n}"], np.mean(rho - np.log(rho) - 1), rtol=1e-12)
