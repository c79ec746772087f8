"""Per-rank HF import (issue 52): equal bitwise to the former whole-dict import, reading only what a rank holds.

1 rank here (Qwen3-MoE from a sharded index with a dense first layer; GLM-4.5 with shared experts, q/k/v
bias and score-correction bias from one file), tp=2 shards read piece by piece against ``tp_slice`` of the
whole converted tensor (tp > 1 MoE cannot be built on CPU), and the errors a bad directory gives. The 2-rank
layouts (ep=2, pp=2) run in the existing torchrun workers (``test_expert_parallel.py``,
``test_pipeline_parallel.py``) through ``hf_import_check``.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl.learner.hf_convert import hf_to_megatron, read_hf_state_dict
from moe_rl.learner.hf_import import HFReader, load_hf_weights, read_plan, read_target
from moe_rl.learner.hf_init import write_random_hf_checkpoint
from moe_rl.learner.model import build_model
from moe_rl.learner.tp_shards import tp_slice, tp_split_dim
from tests.learner.conftest import make_cfg
from tests.learner.hf_import_check import bytes_problems, check_rank_import, uncovered
from tests.learner.test_glm4_moe_parity import GLM

QWEN_DENSE_FIRST = {"num_layers": 3, "first_k_dense_layers": 1, "init_method_std": 0.1}
VARIANTS = {"qwen3_sharded_index": (QWEN_DENSE_FIRST, "40KB"), "glm4_single_file": (GLM, None)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    model, shard = VARIANTS[request.param]
    cfg = make_cfg(**model)
    hf_dir = write_random_hf_checkpoint(cfg.model, tmp_path_factory.mktemp("hf"), seed=3, max_shard_size=shard)
    assert (hf_dir / "model.safetensors.index.json").exists() == (shard is not None)
    return cfg, hf_dir


def test_per_rank_import_equals_the_whole_dict_import_and_reads_each_byte_once(megatron_world, variant, device):
    cfg, hf_dir = variant
    report = check_rank_import(build_model(cfg, seed=99), hf_dir, cfg.model)
    assert report["bitwise_equal"], "per-rank import differs from the whole-dict import"
    assert report["num_tensors"] > 20
    assert not bytes_problems([report]) and not uncovered([report])
    # one rank holds everything: it reads every byte, once
    assert report["bytes_read"] == report["own_bytes"] == report["checkpoint_bytes"], report["bytes_by_file"]
    files = (
        set(json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"].values())
        if (hf_dir / "model.safetensors.index.json").exists()
        else {"model.safetensors"}
    )
    assert set(report["bytes_by_file"]) == files


def test_tp2_shards_read_piece_by_piece_equal_tp_slice_of_the_whole_tensor(megatron_world, variant):
    """Every tensor's tp=2 shards (qkv by query group, SwiGLU fc1 gate/up rows, row-parallel columns,
    vocab rows) equal slicing the whole converted tensor; the two ranks read each byte of a split tensor once."""
    cfg, hf_dir = variant
    full = hf_to_megatron(read_hf_state_dict(hf_dir), cfg.model)
    split = 0
    with HFReader(hf_dir) as reader:
        for t in read_plan(build_model(cfg, seed=1), cfg.model):
            dim = tp_split_dim(t.src)[0]
            if dim is None:
                continue
            split += 1
            before = reader.stats.total_bytes
            for rank in range(2):
                got = read_target(reader, replace(t, dim=dim, rank=rank, size=2), cfg.model)
                assert torch.equal(got, tp_slice(t.src, full[t.src], rank, 2)), f"{t.src} tp rank {rank}"
            assert reader.stats.total_bytes - before == full[t.src].numel() * full[t.src].element_size(), t.src
    assert split > 10


def test_bad_directories_name_the_file_or_tensor(megatron_world, tmp_path):
    cfg = make_cfg()
    src = write_random_hf_checkpoint(cfg.model, tmp_path / "src", seed=0)
    model = build_model(cfg, seed=1)
    state = load_file(src / "model.safetensors")
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(state, src / "model.safetensors")
    with pytest.raises(KeyError, match=r"lacks 1 tensors .*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_hf_weights(model, src, cfg.model)
    index = {"metadata": {}, "weight_map": dict.fromkeys(state, "model-00001-of-00002.safetensors")}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"names 'model-00001-of-00002\.safetensors', which is not in"):
        load_hf_weights(model, src, cfg.model)
    (src / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
        load_hf_weights(model, src, cfg.model)
