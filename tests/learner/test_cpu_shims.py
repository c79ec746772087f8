"""Each CPU shim prevents a real Megatron-Core failure on this machine, and turns itself off when not needed.

Every probe runs in a fresh subprocess (shims are process-wide patches): all shims
but one are applied, then a tiny MoE model with the alltoall dispatcher and full
recompute runs forward + backward (``shim_probe.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.learner.cpu_shims import CPU_SHIMS, applied_shims, apply_cpu_shims
from tests.conftest import repo_env

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU shims guard CPU-only failures; apply_cpu_shims is a no-op with CUDA"
)

PROBE = Path(__file__).with_name("shim_probe.py")
REPO = Path(__file__).resolve().parents[2]

# left-out shim -> (where Megatron fails, error text)
EXPECTED_FAILURES = {
    "cuda_current_device": ("rotary_pos_embedding.", "Torch not compiled with CUDA enabled"),
    "te_general_gemm": ("moe_utils.", "name 'te_general_gemm' is not defined"),
    "dispatcher_stream": ("token_dispatcher.__init__", "torch.cuda.Stream requires CUDA"),
    "split_sizes_numpy": ("", "all_to_all_single(): incompatible function arguments"),
    "cuda_rng_state": ("random._get_cuda_rng_state", "Torch not compiled with CUDA enabled"),
    "cuda_synchronize": ("p2p_communication._communicate_shapes", "Torch not compiled with CUDA enabled"),
}


@pytest.fixture(scope="module")
def probe_results():
    """Run every probe (one import, a forked child per probe) and collect their verdict lines."""
    names = ["none", *EXPECTED_FAILURES]
    proc = subprocess.run(
        [sys.executable, str(PROBE), *names],
        cwd=REPO,
        env=repo_env(REPO, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=240,
        check=False,
    )
    verdicts = dict(ln.split(" ", 1) for ln in proc.stdout.splitlines() if " PROBE-" in ln)
    return {name: verdicts.get(name, f"no verdict (rc={proc.returncode})") for name in names}


@pytest.mark.timeout(300)
def test_all_shims_together_let_megatron_moe_train_on_cpu(probe_results):
    assert probe_results["none"].startswith("PROBE-OK"), probe_results["none"]
    assert probe_results["none"].endswith("applied=" + ",".join(EXPECTED_FAILURES))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("left_out", list(EXPECTED_FAILURES))
def test_leaving_out_one_shim_reproduces_the_failure_it_prevents(probe_results, left_out):
    where, message = EXPECTED_FAILURES[left_out]
    verdict = probe_results[left_out]
    assert verdict.startswith("PROBE-FAIL"), f"without {left_out!r} Megatron still ran: {verdict}"
    assert message in verdict, f"without {left_out!r}: expected {message!r}, got {verdict}"
    assert f"at {where}" in verdict, f"without {left_out!r}: expected the failure in {where!r}, got {verdict}"


def test_shims_are_noops_once_the_failure_is_gone(megatron_world):
    """After patching, every guard's probe reports 'not needed', so re-applying changes nothing."""

    before = applied_shims()
    assert set(before) == set(CPU_SHIMS)  # this CPU-only torch/megatron needs all of them
    patched_current_device = torch.cuda.current_device
    assert apply_cpu_shims() == before
    assert torch.cuda.current_device is patched_current_device
    assert [name for name, (needed, _) in CPU_SHIMS.items() if needed()] == []


def test_unknown_shim_name_is_rejected():
    with pytest.raises(ValueError, match=r"unknown CPU shim\(s\) \['cuda_graphs'\]"):
        apply_cpu_shims(only=("cuda_graphs",))
