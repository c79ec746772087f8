"""Format-4 rank files (``sharded_state``) with the slices ``ownership`` assigns, on hand-made layouts.

A 4-rank job is laid out by hand (tp=2 x dp=2, the distributed optimizer's flat shards of every tp
shard, SwiGLU ``linear_fc1`` with a shard boundary inside a box): each "rank" writes its file, and the
directory must give back the global tensors (built here with ``arange``, not by the code under test).
A missing rank file or an element written twice is refused, naming the file / tensor.
"""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from moe_rl.learner import global_state, ownership, sharded_state
from moe_rl.learner.global_state import GlobalStateError
from moe_rl.learner.ownership import tensor_slice
from moe_rl.learner.sharded_state import ShardedDir, rank_file, write_rank_file
from moe_rl.learner.tp_shards import tp_slice

FULL = {
    "decoder.layers.0.mlp.linear_fc1.weight": torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3),  # SwiGLU
    "decoder.layers.0.self_attention.linear_proj.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100,
    "decoder.layers.0.input_layernorm.weight": torch.tensor([7.0, 8.0, 9.0]),  # replicated over tp
}


def _write_job(directory, tp: int = 2, dp: int = 2, skip: tuple = ()) -> None:
    """Every rank (tp rank t, dp rank d) writes its flat share of its tp shard of each tensor."""
    directory.mkdir(parents=True, exist_ok=True)
    for t in range(tp):
        for d in range(dp):
            entries = []
            for name, full in FULL.items():
                local = tp_slice(name, full, t, tp)
                s = tensor_slice(name, name, tuple(local.shape), t, tp)
                if not s.split and t != 0:
                    continue  # tp-replicated: tp rank 0's copy only
                if dp > 1:
                    n = local.numel()
                    cut = [0, n // 2 - 1, n][d : d + 2]  # uneven: the SwiGLU shard boundary falls inside a box
                    entry = (f"exp_avg/{name}", s, local.reshape(-1)[cut[0] : cut[1]].clone(), (cut[0], cut[1]))
                else:
                    entry = (f"exp_avg/{name}", s, local, None)
                if (name, t, d) not in skip:
                    entries.append(entry)
            write_rank_file(directory, "optimizer", t * dp + d, tp * dp, entries)


def test_flat_shards_of_tp_shards_rebuild_every_global_tensor(tmp_path):
    _write_job(tmp_path)
    src = ShardedDir(tmp_path, "optimizer")
    assert src.keys == {f"exp_avg/{n}" for n in FULL}
    for name, full in FULL.items():
        assert torch.equal(src.full(f"exp_avg/{name}"), full), name


def test_whole_tp_shards_rebuild_every_global_tensor(tmp_path):
    _write_job(tmp_path, dp=1)
    src = ShardedDir(tmp_path, "optimizer")
    for name, full in FULL.items():
        assert torch.equal(src.full(f"exp_avg/{name}"), full), name


def test_a_missing_rank_file_is_refused(tmp_path):
    _write_job(tmp_path)
    rank_file(tmp_path, "optimizer", 2).unlink()
    with pytest.raises(GlobalStateError, match=r"3 rank files for a job of \['4'\] ranks; a rank's file is missing"):
        ShardedDir(tmp_path, "optimizer")


def test_an_uncovered_or_twice_written_element_is_refused(tmp_path):
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    _write_job(tmp_path / "lost", skip=((name, 1, 0),))  # rank 2 (tp 1, dp 0) lost its 5 elements
    with pytest.raises(GlobalStateError, match=rf"exp_avg/{name} is not covered exactly once .*5 elements missing"):
        ShardedDir(tmp_path / "lost", "optimizer").full(f"exp_avg/{name}")
    _write_job(tmp_path / "twice")
    local = tp_slice(name, FULL[name], 1, 2)  # rank 3 writes all of tp shard 1: rank 2's 5 elements again
    s = tensor_slice(name, name, tuple(local.shape), 1, 2)
    write_rank_file(tmp_path / "twice", "optimizer", 3, 4, [(f"exp_avg/{name}", s, local, None)])
    with pytest.raises(GlobalStateError, match=r"0 elements missing, 5 written twice"):
        ShardedDir(tmp_path / "twice", "optimizer").full(f"exp_avg/{name}")


def test_the_state_modules_do_not_import_the_hf_conversion():
    """Issue 34: no import circle between ``global_state`` and ``hf_convert`` (hf_convert imports the gathers
    from global_state, never the other way); the ownership map is shared by both."""

    for module in (global_state, ownership, sharded_state):
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
        }
        assert "moe_rl.learner.hf_convert" not in imported, f"{module.__name__} imports hf_convert"
