"""The kernel identity of ``moe_rl.exact.identity``: what each side reports and how a difference is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.config.kernels import KERNELS
from moe_rl.exact.contract import SERVER_ENV
from moe_rl.exact.identity import (
    IDENTITY_PATH,
    KernelIdentityError,
    identity_mismatch,
    learner_identity,
    served_identities,
    server_identity,
)
from moe_rl.rollout.sglang_entry import _flag_value

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
GATE = ["rollout.true_on_policy=true", "rollout.dtype=float32"]


def test_server_and_learner_of_one_config_on_one_machine_agree():
    mine = learner_identity(load_config(TINY, GATE))
    on = {"MOE_RL_TRUE_ON_POLICY": "1"}
    assert server_identity("float32", True, on) == mine
    assert mine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert mine["kernels"] == ",".join(sorted(KERNELS)) and mine["torch"] == torch.__version__
    assert server_identity("float32", True, {})["kernels"] == "off"  # the mode off: no hooks installed
    assert server_identity("float32", True, {**on, SERVER_ENV: "router,lm_head"})["kernels"] == "lm_head,router"


def test_a_difference_is_named_with_both_identities():
    mine = learner_identity(load_config(TINY, GATE))
    assert identity_mismatch({"http://a": dict(mine)}, mine) is None
    theirs = {**mine, "cpu_capability": "AVX2", "dtype": "bfloat16"}
    why = identity_mismatch({"http://a": dict(mine), "http://b": theirs}, mine)
    assert why.startswith("made under another kernel identity than this learner's (cpu_capability: server 'AVX2' vs ")
    assert (
        "dtype: server 'bfloat16' vs learner 'float32'" in why and "server http://b: {" in why and "learner: {" in why
    )


def test_the_entry_reads_the_dtype_from_the_server_argv():
    assert _flag_value(["--model-path", "m", "--dtype", "bfloat16"], "--dtype") == "bfloat16"
    assert _flag_value(["--dtype=float32"], "--dtype") == "float32" and _flag_value([], "--dtype") is None


def test_a_server_that_cannot_say_is_named():
    """Nothing listens on port 1: one error naming the server and the endpoint, not an httpx traceback."""
    with pytest.raises(KernelIdentityError, match=rf"server http://127.0.0.1:1 does not report .*{IDENTITY_PATH}"):
        served_identities(["http://127.0.0.1:1"], timeout_s=5)
