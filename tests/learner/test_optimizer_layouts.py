"""Every distributed-optimizer layout the cluster configs ship saves and loads (issue 52, item 2).

``configs/qwen3_235b_a22b.yaml`` and ``configs/deepseek_v3_style.yaml`` run Megatron's distributed optimizer with
``optimizer_cpu_offload`` and ``use_precision_aware_optimizer``: ``HybridDeviceOptimizer`` (HDO) steps a host
fp32 copy of each bf16 shard and keeps it in its state as ``master_param``, and ``shard_main_param`` is None.
With offload alone (an override) ``shard_main_param`` is an fp32 clone and HDO steps a host copy of it. Neither
can be built on a CPU as is, so the test builds the real ``DistributedOptimizer`` + ``HybridDeviceOptimizer``
with GPU stand-ins, each named below, and checks the state layouts: save -> load -> one more step equals the
uninterrupted run bit for bit, the saved master is the tensor Megatron's own accessor
(``_get_main_param_and_optimizer_states``) calls ``param``, and the checkpoint resumes into the no-offload layout.
The host<->device copies themselves are GPU-only (``make gpu-check``); dp=2 -> dp=2 and dp=2 -> dp=1 are in
``tests/distributed/test_distributed_optimizer.py``. The stand-ins and the all-bf16 model: ``offload_layouts``.

Break tried: ``optimizer_slots`` as before (``shard_fp32_from_float16_groups``: a slot with ``main=None`` under
offload + precision-aware) fails both layouts (TypeError in ``zeros_like`` / ``['master_param']``); a load that
skips HDO's host copy under offload alone fails the bit-for-bit resume.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.learner.checkpoint import load_checkpoint, save_checkpoint
from moe_rl.learner.global_state import optimizer_slots
from moe_rl.learner.sharded_state import read_global
from moe_rl.learner.train_step import Learner
from tests.distributed.distopt_data import data_shard, nll
from tests.distributed.offload_layouts import LAYOUTS, gpu_stand_ins, offload_learner


def _both(step: int) -> list[dict]:
    return [data_shard(0, step), data_shard(1, step)]


def _params(lrn: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lrn.module.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_layout_saves_loads_and_resumes_bit_for_bit(layout, megatron_world, device, tmp_path):
    with gpu_stand_ins(device):
        a = offload_learner(LAYOUTS[layout])
        assert type(a.optimizer.chained_optimizers[0].optimizer).__name__ == "HybridDeviceOptimizer"
        a.train_step(_both(1), nll)
        d = save_checkpoint(a, tmp_path / "ckpt")
        want = a.train_step(_both(2), nll)
        want_params = _params(a)

        b = offload_learner(LAYOUTS[layout], seed=11)  # other initial weights: everything must load
        load_checkpoint(b, tmp_path / "ckpt")
        got = b.train_step(_both(2), nll)
    assert (got.loss, got.grad_norm) == (want.loss, want.grad_norm), (got, want)
    got_params = _params(b)
    for n, p in want_params.items():
        assert torch.equal(got_params[n], p), f"{layout}: {n} differs after the resumed step"

    # the saved master is Megatron's own main param (fp32), read back from the files; one slot per bf16 param
    saved = read_global(d, "optimizer")
    names = {id(p): n for n, p in a.module.named_parameters()}
    for slot in optimizer_slots(b.optimizer):
        assert slot.main is not None and slot.main.dtype == torch.float32, f"{layout}: {names[id(slot.param)]}"
    with gpu_stand_ins(device):
        a_again = offload_learner(LAYOUTS[layout], seed=5)
        load_checkpoint(a_again, tmp_path / "ckpt")
    for dist_opt in a_again.optimizer.chained_optimizers:
        for group in dist_opt.model_float16_groups:
            for p in group:
                name = next(n for n, q in a_again.module.named_parameters() if q is p)
                lo, hi = (r := dist_opt._get_model_param_range_map(p)["param"]).start, r.end
                main = dist_opt._get_main_param_and_optimizer_states(p)["param"]
                assert torch.equal(saved[f"main/{name}"].reshape(-1)[lo:hi], main.cpu()), f"{layout}: main/{name}"


def test_an_offload_checkpoint_resumes_without_offload(megatron_world, device, tmp_path):
    """The layouts share one format: offload + precision-aware -> the no-offload distributed optimizer (the 30B
    layout). Both step the same fp32 master with torch AdamW (HDO's fused, the other's foreach): equal to 1e-6."""
    with gpu_stand_ins(device):
        a = offload_learner(LAYOUTS["offload+precision_aware"])
        a.train_step(_both(1), nll)
        save_checkpoint(a, tmp_path / "ckpt")
        want = a.train_step(_both(2), nll)
    b = offload_learner({}, seed=11)
    load_checkpoint(b, tmp_path / "ckpt")
    got = b.train_step(_both(2), nll)
    assert (
        abs(got.loss - want.loss) <= 1e-6 * abs(want.loss)
        and abs(got.grad_norm - want.grad_norm) <= 1e-5 * want.grad_norm
    )
