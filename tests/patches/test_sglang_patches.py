"""moe_rl's SGLang source patches against the pristine pinned wheel, and the stand-in packages.

The wheel is downloaded once (`pip download --no-deps`) into $MOE_RL_CACHE_DIR/wheels (default
~/.cache/moe_rl/wheels); only the files the patches touch are extracted per test.
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "patches" / "apply.py"
VERSION = "0.5.23"


def _load_apply():
    spec = importlib.util.spec_from_file_location("moe_rl_patches_apply", APPLY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


apply = _load_apply()


@pytest.fixture(scope="session")
def pristine_wheel() -> Path:
    cache = Path(os.environ.get("MOE_RL_CACHE_DIR", Path.home() / ".cache" / "moe_rl")) / "wheels"
    found = sorted(cache.glob(f"sglang-{VERSION}-*.whl"))
    if not found:
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", f"sglang=={VERSION}", "-d", str(cache)],
            check=True,
        )
        found = sorted(cache.glob(f"sglang-{VERSION}-*.whl"))
    assert found, f"pip download left no sglang-{VERSION} wheel in {cache}"
    return found[0]


def _patched_paths() -> list[str]:
    paths = []
    for patch in apply.patches_for(VERSION):
        paths += [m[len("b/") :] for m in re.findall(r"^\+\+\+ (\S+)", patch.read_text(), flags=re.MULTILINE)]
    return sorted(set(paths))


@pytest.fixture
def pristine_root(pristine_wheel, tmp_path) -> Path:
    """tmp dir holding `sglang/...` with exactly the wheel's copies of the patched files."""
    with zipfile.ZipFile(pristine_wheel) as whl:
        for path in _patched_paths():
            whl.extract(path, tmp_path)
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p: (root / p).read_bytes() for p in _patched_paths()}


def test_every_patch_applies_cleanly_to_the_pristine_wheel(pristine_root):
    statuses = apply.apply_patches(pristine_root, VERSION)
    assert [s.state for s in statuses] == ["applied"] * len(statuses)
    for path, text in _snapshot(pristine_root).items():
        assert b"moe_rl:" in text or b"moe_rl patch" in text, f"{path} shows no moe_rl change after patching"


def test_applying_twice_is_a_no_op(pristine_root):
    apply.apply_patches(pristine_root, VERSION)
    first = _snapshot(pristine_root)
    statuses = apply.apply_patches(pristine_root, VERSION)
    assert {s.state for s in statuses} == {"already-applied"}
    assert _snapshot(pristine_root) == first


def test_check_mode_changes_nothing(pristine_root):
    before = _snapshot(pristine_root)
    assert {s.state for s in apply.apply_patches(pristine_root, VERSION, check=True)} == {"would-apply"}
    assert _snapshot(pristine_root) == before


def test_a_version_without_patches_is_refused(pristine_root, capsys):
    with pytest.raises(apply.PatchError, match="no moe_rl patches written for sglang '0.5.22'"):
        apply.apply_patches(pristine_root, "0.5.22")
    assert apply.main(["--root", str(pristine_root), "--version", "0.5.22"]) == 2
    assert "0.5.23" in capsys.readouterr().err, "the error should list the versions that do have patches"


def test_files_that_differ_from_the_wheel_are_refused_untouched(pristine_root):
    target = pristine_root / "sglang/srt/arg_groups/choices.py"
    target.write_text(target.read_text().replace('    "triton",\n]', '    "triton",\n    "local-edit",\n]', 1))
    before = target.read_bytes()
    with pytest.raises(apply.PatchError, match="differ from the pristine"):
        apply.apply_patches(pristine_root, VERSION)
    assert target.read_bytes() == before


def test_installed_sglang_is_fully_patched():
    pytest.importorskip("sglang", reason="sglang is installed by scripts/install_sglang.sh")
    version, root = apply.installed_sglang()
    assert version == VERSION
    assert {s.state for s in apply.apply_patches(root, version, check=True)} == {"already-applied"}


def _murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Reference MurmurHash3_x86_32 over bytes (Appleby's algorithm), written from its specification."""
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        k = (k * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        k = (k * c2) & mask
        h ^= k
        h = ((h << 13) | (h >> 19)) & mask
        h = (h * 5 + 0xE6546B64) & mask
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def test_cpu_murmur_hash_fallback_equals_reference_murmur3():
    """Patch 0004: seeded sampling on CPU hashes (seed u64, position u32, column u32) like the Triton kernel."""
    pytest.importorskip("sglang")
    torch = pytest.importorskip("torch")
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32  # noqa: PLC0415 -- SGLang is optional (the rollout engine), heavy to import

    rng = np.random.default_rng(0)
    edge = np.array([0, 2**63, 2**64 - 1], dtype=np.uint64)
    seeds = np.concatenate([rng.integers(0, 2**64 - 1, 5, dtype=np.uint64, endpoint=True), edge])
    positions = rng.integers(0, 2**31, len(seeds))
    cols = np.arange(37)
    got = murmur_hash32(
        torch.from_numpy(seeds.view(np.int64)).to(torch.uint64),
        torch.from_numpy(positions),
        torch.from_numpy(cols),
    )
    assert got.dtype == torch.uint32 and got.shape == (len(seeds), len(cols))
    for i, (s, p) in enumerate(zip(seeds.tolist(), positions.tolist())):
        for c in cols.tolist():
            key = struct.pack("<IIII", s & 0xFFFFFFFF, s >> 32, p, c)
            assert int(got[i, c]) == _murmur3_x86_32(key), f"row {i} (seed {s}, pos {p}) col {c}"


def _stub_run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "patches" / "stubs")}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_stand_ins_import_and_fail_loudly_when_called():
    out = _stub_run(
        "import sgl_kernel, torchvision\n"
        "from torchvision.transforms import InterpolationMode\n"
        "from sgl_kernel.kvcacheio import transfer_kv_per_layer\n"
        "modes = {InterpolationMode.BICUBIC: 1}\n"
        "try:\n    transfer_kv_per_layer(1)\nexcept RuntimeError as e:\n    print('RAISED', type(e).__name__)\n"
    )
    assert out.returncode == 0, out.stderr
    assert "RAISED StandInCalled" in out.stdout
    assert "moe_rl stand-in: sgl_kernel.kvcacheio.transfer_kv_per_layer was called" in out.stderr


def test_stand_ins_are_not_on_the_learner_path():
    assert importlib.util.find_spec("sgl_kernel") is None, "sgl_kernel must only exist in the server's PYTHONPATH"
