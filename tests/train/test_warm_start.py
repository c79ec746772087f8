"""Warm start: the teacher-forcing batch layout, a real Megatron SFT that measurably helps, the safetensors cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moe_rl.config import ParallelConfig, load_config
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.model import forward_logits
from moe_rl.learner.train_step import Learner
from moe_rl.tasks.synthetic import DigitTask
from moe_rl.tasks.tokenizer import EOS_ID, PAD_ID, build_task_tokenizer
from moe_rl.train import warm_start
from moe_rl.train.warm_start import apply_warm_start, cache_path, sft_microbatch, temper, warm_start_key

ROOT = Path(__file__).parents[2]
torch.set_num_threads(1)


def demo_cfg(tmp_path: Path, *overrides: str):
    return load_config(
        ROOT / "configs/demo.yaml",
        [
            f"train.warm_start.cache_dir={tmp_path / 'cache'}",
            "train.warm_start.steps=60",
            "train.warm_start.temperature=1",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def world():
    return init_distributed(ParallelConfig(), environ={})


def test_sft_batch_puts_the_loss_on_answer_and_eos_targets_only(device):
    task, tok = DigitTask("copy_long", 64), build_task_tokenizer(64)
    short, long = task.make_prompt([1, 2, 3, 4, 5, 6, 7]), task.make_prompt([9] * 9)
    mb = sft_microbatch([short, long], device)
    text = tok("copy : 1 2 3 4 5 6 7 >", add_special_tokens=False).input_ids
    seq = [tok.bos_token_id, *text, *tok("1 2 3 4 5 6 7", add_special_tokens=False).input_ids, EOS_ID]
    T = 1 + 2 + 9 + 1 + 9 + 1 - 1  # the long row: bos, "copy :", 9 digits, ">", 9 digits, eos; minus one
    assert mb["input_ids"].shape == mb["targets"].shape == mb["mask"].shape == (2, T)
    assert mb["input_ids"].device.type == device.type
    n = len(seq) - 1
    assert mb["input_ids"][0, :n].tolist() == seq[:-1] and mb["input_ids"][0, n:].eq(PAD_ID).all()
    assert mb["targets"][0, :n].tolist() == seq[1:] and mb["targets"][0, n:].eq(-1).all()
    assert [seq[1:][t] for t in mb["mask"][0].nonzero().flatten().tolist()] == seq[len(text) + 1 :]  # answer + eos
    assert int(mb["mask"][1].sum()) == 10


def _answer_nll(module, cfg, device) -> float:
    """Mean NLL of held-out prompts' answers under ``module`` (independent of the SFT's own bookkeeping)."""

    prompts = DigitTask(cfg.train.task, cfg.model.vocab_size).sample_prompts(64, np.random.default_rng(12345))
    mb = sft_microbatch(prompts, device)
    with torch.no_grad():
        logp, _ = response_logprobs(module, mb["input_ids"], mb["targets"], with_entropy=False)
    return float(-(logp * mb["mask"]).sum() / mb["mask"].sum())


def test_warm_start_trains_caches_and_reloads_the_same_weights(world, tmp_path, device, monkeypatch):
    cfg = demo_cfg(tmp_path)
    fresh = Learner(cfg)
    before = _answer_nll(fresh.module, cfg, device)
    info = warm_start.apply_warm_start(fresh, cfg)
    after = _answer_nll(fresh.module, cfg, device)
    assert not info["cached"] and before - after > 0.3, (before, after)
    files = sorted(p.name for p in (tmp_path / "cache").glob("*/*"))
    assert files == ["meta.json", "rank_00000.safetensors"]

    # A second learner with another RL seed gets the same weights from the cache, without training.
    monkeypatch.setattr(warm_start, "train_warm_start", lambda *a, **k: pytest.fail("trained despite a cache"))
    other_seed = demo_cfg(tmp_path, "train.seed=99", "rollout.seed=99")
    again = Learner(other_seed)
    assert warm_start.apply_warm_start(again, other_seed)["cached"]
    for (name, a), (_, b) in zip(fresh.module.state_dict().items(), again.module.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name


def test_cache_key_follows_model_task_and_warm_start_settings_not_the_rl_seed(tmp_path):
    base = warm_start_key(demo_cfg(tmp_path))
    assert warm_start_key(demo_cfg(tmp_path, "train.seed=5", "rollout.seed=5", "optim.lr=0.1")) == base
    for change in (
        "train.warm_start.steps=61",
        "train.warm_start.lr=0.01",
        "train.warm_start.seed=1",
        "model.hidden_size=96",
        "train.task=reverse_long",
        "precision.params_dtype=bfloat16",
        "train.warm_start.temperature=3",
    ):
        assert warm_start_key(demo_cfg(tmp_path, change)) != base, change


def test_a_cache_file_for_another_model_is_one_clear_error(world, tmp_path):
    cfg = demo_cfg(tmp_path)
    directory = cache_path(cfg)
    directory.mkdir(parents=True)
    save_file({"not.a.weight": torch.zeros(2)}, str(directory / "rank_00000.safetensors"))
    (directory / "meta.json").write_text('{"history": [{"nll": 1.0}]}')
    with pytest.raises(ValueError, match="does not fit model.*delete it or change train.warm_start.cache_dir"):
        apply_warm_start(Learner(cfg), cfg)


def test_no_warm_start_configured_is_a_no_op(world, tmp_path):
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml")
    learner = Learner(cfg)
    before = {k: v.clone() for k, v in learner.module.state_dict().items() if torch.is_tensor(v)}
    assert apply_warm_start(learner, cfg) is None
    assert all(torch.equal(v, learner.module.state_dict()[k]) for k, v in before.items())


def test_temperature_hands_rl_the_same_policy_at_temperature_t(world, tmp_path, device):
    """``temper`` divides every logit by T: log_softmax(z / T), same argmax, flatter samples."""

    cfg = demo_cfg(tmp_path)
    policy, tempered = Learner(cfg), Learner(cfg)
    weights = {k: v for k, v in policy.module.state_dict().items() if torch.is_tensor(v)}
    assert temper(weights, 1.0) is weights
    tempered.module.load_state_dict(temper(weights, 3.0), strict=False)
    prompts = DigitTask(cfg.train.task, cfg.model.vocab_size).sample_prompts(8, np.random.default_rng(0))
    ids = sft_microbatch(prompts, device)["input_ids"]
    with torch.no_grad():
        z, z_t = forward_logits(policy.model, ids).float(), forward_logits(tempered.model, ids).float()
    torch.testing.assert_close(z_t.log_softmax(-1), (z / 3.0).log_softmax(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(z_t.argmax(-1), z.argmax(-1))
    assert weights["output_layer.weight"].abs().sum() > 0 and not torch.equal(
        tempered.module.state_dict()["output_layer.weight"], weights["output_layer.weight"]
    )
