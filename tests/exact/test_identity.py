"""The kernel identity of ``moe_rl.exact.identity``: what each side reports and how a difference is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.config.kernels import KERNELS
from moe_rl.exact import identity as identity_module
from moe_rl.exact.contract import SERVER_ENV
from moe_rl.exact.identity import (
    IDENTITY_PATH,
    MKL_KEYS,
    KernelIdentityError,
    identity_mismatch,
    learner_identity,
    mkl_identity,
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
    assert {k: mine[k] for k in MKL_KEYS} == mkl_identity()  # MKL's code path (its version, instruction set, CBWR)
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


def _mkl_identities_under(*settings: dict[str, str]) -> list[dict[str, str]]:
    """``mkl_identity()`` of one fresh process per ``settings`` (MKL reads its variables once, at its first call),
    all started at once, each in this process's environment plus its settings."""
    probe = "import json; from moe_rl.exact.identity import mkl_identity; print(json.dumps(mkl_identity()))"
    procs = [
        subprocess.Popen([sys.executable, "-c", probe], env={**os.environ, **s}, stdout=subprocess.PIPE, text=True)
        for s in settings
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL: no MKL code path to force")
def test_mkl_reports_the_code_path_its_variables_select():
    """MKL_CBWR=COMPATIBLE and AUTO,STRICT change the exact kernels' GEMM tiles here (docs/true_on_policy.md):
    each is another identity, MKL's own report says which (an unset MKL_CBWR is OFF), and the difference is named."""
    if os.environ.get("MKL_CBWR"):
        pytest.skip(f"this session runs under MKL_CBWR={os.environ['MKL_CBWR']}")
    unset = mkl_identity()
    compatible, strict = _mkl_identities_under({"MKL_CBWR": "COMPATIBLE"}, {"MKL_CBWR": "AUTO,STRICT"})
    assert unset["mkl_cbwr"] == "OFF" and unset["mkl"] and unset["mkl_isa"]
    assert compatible["mkl_cbwr"] == "COMPATIBLE" and compatible["mkl_isa"] != unset["mkl_isa"]
    assert strict == {**unset, "mkl_cbwr": "AUTO,STRICT"}
    base = learner_identity(load_config(TINY, GATE))
    for other in (compatible, strict):
        why = identity_mismatch({"http://a": {**base, **unset}}, {**base, **other})
        assert why and f"mkl_cbwr: server 'OFF' vs learner {other['mkl_cbwr']!r}" in why


def test_an_identity_without_the_mkl_keys_is_refused_naming_them():
    """A server of a moe_rl from before the MKL keys (or records it stamped) is refused, not trusted: the keys
    it does not report are named as such, and so is the remedy."""
    mine = learner_identity(load_config(TINY, GATE))
    old = {k: v for k, v in mine.items() if k not in MKL_KEYS}
    why = identity_mismatch({"http://old": old}, mine)
    assert f"mkl: server (not reported) vs learner {mine['mkl']!r}" in why
    assert "server http://old does not report mkl, mkl_cbwr, mkl_isa (an older moe_rl: restart it)" in why


def test_an_mkl_without_its_service_functions_is_named_by_its_variables(monkeypatch):
    """An MKL that exports no service functions (not this torch's: only the lookup is replaced) is identified by
    the variables that select its path, and by the version torch was built with."""
    real = mkl_identity()
    monkeypatch.setattr(identity_module, "_loaded_mkl", lambda: None)
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert mkl_identity() == {"mkl": real["mkl"], "mkl_isa": "MKL_ENABLE_INSTRUCTIONS=", "mkl_cbwr": "MKL_CBWR=AVX2"}
