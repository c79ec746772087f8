"""Preflight: every shipped config passes, each rule refuses with its exact message, the CLI reports all."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest
import torch

from moe_rl.cli import main
from moe_rl.config import ConfigError, load_config
from moe_rl.learner.model import use_transformer_engine
from moe_rl.preflight import PreflightError, config_problems, environment_problems, preflight

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").rglob("*.yaml"))


# model.hf_path that `make math-example` / `make agent-example` builds -> the fixture building it without its SFT
BUILT_BY_SCRIPT = {"math_cpu.yaml": "example_model", "agent_cpu.yaml": "agent_example_model"}


def _unbuilt_example(tmp_path_factory, name: str, **kwargs) -> Path:
    """``scripts/make_<name>_example.py``'s HF directory without its SFT (its tokenizer, template, random weights)."""

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(f"make_{name}_example", root / f"scripts/make_{name}_example.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path_factory.mktemp(f"{name}_example") / "model"
    script.write_model(root / f"examples/{name}", out, sft_steps=0, **kwargs)
    return out


@pytest.fixture(scope="module")
def example_model(tmp_path_factory):
    """The math example's HF directory without its SFT (tokenizer, chat template, config, random weights)."""
    return _unbuilt_example(tmp_path_factory, "math")


@pytest.fixture(scope="module")
def agent_example_model(tmp_path_factory):
    """The multi-turn example's HF directory without its SFT (tool-calling tokenizer and template, random weights)."""
    return _unbuilt_example(tmp_path_factory, "agent", tool_fraction=0.0)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_shipped_config_passes_the_config_rules(path, request):
    overrides = []
    if path.name in BUILT_BY_SCRIPT:  # its model directory is built locally, not committed
        overrides = [f"model.hf_path={request.getfixturevalue(BUILT_BY_SCRIPT[path.name])}"]
    assert config_problems(load_config(path, overrides)).problems == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.max_new_tokens=60"],
            (
                "rollout.max_new_tokens=60 plus the 7-token prompt of train.task='copy' exceeds model.seq_length=64; "
                "expected rollout.max_new_tokens <= 57 or model.seq_length >= 67"
            ),
        ),
        (
            ["model.seq_length=4"],
            (
                "rollout.max_new_tokens=4 plus the 7-token prompt of train.task='copy' exceeds model.seq_length=4; "
                "expected model.seq_length >= 11"
            ),
        ),
        (["rollout.top_k=0"], "rollout.top_k=0 samples from no token; expected -1 (no top-k) or >= 1"),
        (["optim.lr=.inf"], "optim.lr=inf is not a finite number; expected a finite value"),
        (["loss.clip_high=.inf"], "loss.clip_high=inf is not a finite number; expected a finite value"),
        (
            ["train.task=bogus"],
            "train.task='bogus' is not a known task; expected one of ['add', 'copy', 'copy_long', 'max', 'reverse', 'reverse_long', 'sort', 'sort_long']",
        ),
        (
            ["model.vocab_size=16", "rollout.top_k=8"],
            "model.vocab_size=16 is too small for the task vocabulary (26 tokens)",
        ),
        (
            ["train.reward_fn=no_such_module:score"],
            "train.reward_fn='no_such_module:score' cannot be imported: No module named 'no_such_module'",
        ),
        (
            ["train.reward_fn=json:no_such_fn"],
            "train.reward_fn='json:no_such_fn' cannot be imported: module 'json' has no attribute 'no_such_fn'",
        ),
        (["train.reward_fn=json"], "train.reward_fn='json' must look like 'package.module:function'"),
        (
            ["rollout.top_k=50", "rollout.sampling_mask_max_tokens=32"],
            (
                "rollout.top_k=50 exceeds rollout.sampling_mask_max_tokens=32 (the largest kept set SGLang returns for "
                "replay.keep_sampling_mask); lower top_k or raise the cap"
            ),
        ),
        (
            ["model.mtp_num_layers=1"],
            (
                "model.mtp_num_layers=1: multi-token prediction layers are neither built by the learner nor exported to "
                "SGLang; expected 0"
            ),
        ),
        (
            ["parallel.tp=2", "loss.entropy_coef=0.01"],
            (
                "replay.keep_sampling_mask=true with parallel.tp=2 and loss.entropy_coef=0.01: the kept-set entropy is not "
                "computed on vocab-sharded logits yet (the kept-set log-prob is); expected loss.entropy_coef=0 or "
                "parallel.tp=1"
            ),
        ),
        (
            ["parallel.pp=2", "model.first_k_dense_layers=1"],
            (
                "parallel.pp=2: pipeline stage(s) [0] would hold only dense layers (model.first_k_dense_layers=1, "
                "model.moe_layer_freq=1, 1 decoder layer(s) per stage); expected every stage to hold a MoE layer: lower "
                "parallel.pp"
            ),
        ),
        (
            ["parallel.pp=2", "model.moe_token_dispatcher_type=allgather"],
            (
                "model.moe_token_dispatcher_type='allgather' with parallel.pp=2: Megatron-Core refuses the allgather "
                "dispatcher with variable_seq_lengths, which pipeline stages need for ragged microbatches; "
                "expected 'alltoall'"
            ),
        ),
        (
            ["train.rollout_mode=async", "train.rollouts_from=/tmp/records"],
            (
                "train.rollout_mode=async overlaps generation with training; train.rollouts_from trains on saved records "
                "without servers (set train.rollout_mode=sync)"
            ),
        ),
        (
            ["parallel.cp=2"],
            "parallel.cp=2: the training loop does not split sequences over context parallelism; expected 1",
        ),
        (
            ["optim.optimizer_cpu_offload=true"],
            (
                "optim.optimizer_cpu_offload=true needs optim.use_distributed_optimizer=true (Megatron-Core keeps offloaded "
                "and lower-precision optimizer state only in its distributed optimizer)"
            ),
        ),
        (
            ["optim.use_precision_aware_optimizer=true"],
            (
                "optim.use_precision_aware_optimizer=true needs optim.use_distributed_optimizer=true (Megatron-Core keeps "
                "offloaded and lower-precision optimizer state only in its distributed optimizer)"
            ),
        ),
        (
            ["optim.optimizer_offload_fraction=0.5", "optim.use_distributed_optimizer=true"],
            (
                "optim.optimizer_offload_fraction=0.5 has no effect without optim.optimizer_cpu_offload=true; expected 1.0 "
                "or offload on"
            ),
        ),
        (
            ["model.moe_router_score_function=sigmoid"],
            (
                "model.moe_router_score_function='sigmoid' (Qwen3-MoE routes with softmax): the HF <-> Megatron bridge "
                "(weight sync to SGLang) cannot express it"
            ),
        ),
        (
            ["model.moe_router_num_groups=2", "model.moe_router_group_topk=1"],
            (
                "model.moe_router_num_groups=2 (Qwen3-MoE has no group-limited top-k): the HF <-> Megatron bridge "
                "(weight sync to SGLang) cannot express it"
            ),
        ),
    ],
)
def test_config_rule_message(overrides, message):
    cfg = load_config(CONFIGS[0].parent / "tiny_cpu.yaml", overrides)
    assert config_problems(cfg).problems == [message]
    with pytest.raises(PreflightError, match="cannot run"):
        preflight(cfg, env=False)


def test_two_equal_stages_each_with_a_moe_layer_pass_and_unequal_stages_do_not_load():
    assert config_problems(load_config(CONFIGS[0].parent / "tiny_cpu.yaml", ["parallel.pp=2"])).problems == []
    with pytest.raises(ConfigError, match=r"parallel.pp=3 must divide model.num_layers=2"):
        load_config(CONFIGS[0].parent / "tiny_cpu.yaml", ["parallel.pp=3"])


def test_every_problem_is_reported_at_once():
    cfg = load_config(overrides=["rollout.top_k=0", "optim.lr=.inf", "train.task=nope", "model.mtp_num_layers=1"])
    assert [p.split("=")[0] for p in config_problems(cfg).problems] == [
        "optim.lr",
        "rollout.top_k",
        "train.task",
        "model.mtp_num_layers",
    ]


def test_untruncated_keep_sampling_mask_is_a_noted_noop():
    cfg = load_config(overrides=["replay.keep_sampling_mask=true", "rollout.top_p=1.0", "rollout.top_k=-1"])
    report = config_problems(cfg)
    assert report.problems == [] and "Keep Sampling Mask is a no-op" in report.notes[0]
    assert config_problems(load_config(overrides=["replay.keep_sampling_mask=true", "rollout.top_p=0.9"])).notes == []


def test_process_count_rule():
    cfg = load_config(overrides=["parallel.ep=2"])
    assert environment_problems(cfg, {"WORLD_SIZE": "2"}).problems == []
    assert environment_problems(cfg, {"WORLD_SIZE": "1"}).problems == [
        (
            "parallel.tp=1 pp=1 cp=1 ep=2 etp=1 need a process count divisible by tp*pp*cp=1 and etp*ep*pp=2; "
            "this run has WORLD_SIZE=1 (start it with torchrun --nproc-per-node 2, or lower the sizes)"
        )
    ]


def test_data_parallel_ranks_must_share_each_minibatch():
    cfg = load_config(overrides=["train.prompts_per_step=3", "rollout.samples_per_prompt=1"])
    assert environment_problems(cfg, {"WORLD_SIZE": "2"}).problems == [
        (
            "each minibatch has 3 samples (train.prompts_per_step x rollout.samples_per_prompt / "
            "train.minibatches_per_step), which the 2 data-parallel ranks of WORLD_SIZE=2 cannot share equally; "
            "make it a multiple of 2"
        )
    ]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_rollout_address_is_an_environment_problem():
    url = f"http://127.0.0.1:{_closed_port()}"
    problems = environment_problems(load_config(overrides=[f"rollout.addresses=[{url}]"]), {}).problems
    assert len(problems) == 1 and problems[0].startswith(
        f"rollout.addresses: {url}/health is not reachable (ConnectError"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_gpu_settings_are_environment_problems_on_cpu():
    assert not use_transformer_engine()
    cfg = load_config(overrides=["parallel.tp=2", "rollout.device=cuda", "precision.fp8={}"])
    assert config_problems(cfg).problems == []
    problems = environment_problems(cfg, {"WORLD_SIZE": "2"}).problems
    assert problems[0] == (
        "parallel.tp=2 needs Transformer Engine on a GPU (Megatron-Core trains MoE with tp > 1 only under sequence "
        "parallelism); expected parallel.tp=1 on this machine"
    )
    assert problems[1].startswith("precision.fp8 needs ") and problems[1].endswith(
        "expected precision.fp8=null on this machine"
    )
    assert problems[2] == (
        "rollout.device='cuda' launches SGLang on a GPU, and this machine has none; expected rollout.device='cpu'"
    )


PA_ONLY = ["optim.use_distributed_optimizer=true", "optim.use_precision_aware_optimizer=true"]


@pytest.mark.parametrize(
    "overrides, refused",
    [
        ([*PA_ONLY, "checkpoint.save_interval=0"], True),  # TE FusedAdam's layout; SLURM's warning (USR1) saves
        ([*PA_ONLY, "launch.signal=null", "checkpoint.save_interval=5"], True),
        ([*PA_ONLY, "launch.signal=null", "checkpoint.save_interval=0"], False),
        ([*PA_ONLY, "optim.optimizer_cpu_offload=true", "checkpoint.save_interval=5"], False),  # 235B/DeepSeek: saved
        (["optim.use_distributed_optimizer=true", "optim.optimizer_cpu_offload=true"], False),  # offload alone: saved
    ],
    ids=["pa", "pa_interval", "pa_no_midway_save", "offload_pa", "offload"],
)
def test_only_the_optimizer_layout_checkpoints_cannot_save_is_refused(overrides, refused):
    """Issue 52 item 2: precision-aware without offload (TE FusedAdam) until a mid-run save cannot happen; the
    layouts the cluster configs ship save (tests/learner/test_optimizer_layouts.py)."""
    problems = config_problems(load_config(CONFIGS[0].parent / "tiny_cpu.yaml", overrides)).problems
    assert [p for p in problems if "FusedAdam" in p] == (
        [
            (
                "optim.use_precision_aware_optimizer=true without optim.optimizer_cpu_offload: Transformer Engine's "
                "FusedAdam keeps the master weights and moments inside itself, a layout checkpoints cannot save yet, and "
                f"checkpoint.save_interval={'5' if 'checkpoint.save_interval=5' in overrides else '0'} / launch.signal="
                f"{'None' if 'launch.signal=null' in overrides else 'USR1'} would save mid-run; expected "
                "optim.optimizer_cpu_offload=true, use_precision_aware_optimizer=false, or checkpoint.save_interval=0 and "
                "launch.signal=null (then only the save after the last step fails)"
            )
        ]
        if refused
        else []
    ), problems


def test_optimizer_flags_that_need_a_gpu_are_environment_problems_on_cpu():
    problems = environment_problems(load_config(overrides=PA_ONLY), {"WORLD_SIZE": "1"}).problems
    assert problems == [
        (
            "optim.use_precision_aware_optimizer=true without optim.optimizer_cpu_offload needs Transformer Engine's "
            "FusedAdam on a GPU; expected false on this machine"
        )
    ]
    cfg = load_config(overrides=[*PA_ONLY, "optim.optimizer_cpu_offload=true"])
    assert environment_problems(cfg, {"WORLD_SIZE": "1"}).problems == [
        (
            "optim.optimizer_cpu_offload=true moves the optimizer state from the GPU to the host, and this machine has "
            "none; expected false on this machine"
        )
    ]


# --- loader: paths that are not YAML files, duplicate keys ---------------------------------------


def test_duplicate_key_names_the_dotted_key_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  steps: 3\n  seed: 1\n  steps: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (
        str(info.value) == f"{path}: duplicate key 'train.steps' (lines 2 and 4); each key may appear once per section"
    )


def test_directory_and_binary_config_paths_are_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(info.value) == f"config path {tmp_path} is a directory; expected a YAML file"
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError) as info:
        load_config(binary)
    assert str(info.value) == f"config path {binary} is not a UTF-8 text file; expected a YAML file"


# --- CLI: one override syntax everywhere ---------------------------------------------------------


def test_validate_takes_positional_overrides_and_set_alias(capsys):
    tiny = str(CONFIGS[0].parent / "tiny_cpu.yaml")
    assert main(["config", "validate", tiny, "rollout.top_k=0", "--set", "optim.lr=.inf", "train.task=nope"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: {tiny} cannot run:\n"
        "  optim.lr=inf is not a finite number; expected a finite value\n"
        "  rollout.top_k=0 samples from no token; expected -1 (no top-k) or >= 1\n"
        "  train.task='nope' is not a known task; expected one of ['add', 'copy', 'copy_long', 'max', 'reverse', 'reverse_long', 'sort', 'sort_long']\n"
    )
    assert main(["config", "validate", tiny, "train.steps=3"]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {tiny} (tiny_cpu")


def test_show_takes_set_alias_and_positional_after_it(capsys):
    tiny = str(CONFIGS[0].parent / "tiny_cpu.yaml")
    assert main(["config", "show", tiny, "--set", "train.steps=3", "rollout.top_k=5"]) == 0
    out = capsys.readouterr().out
    assert "  steps: 3\n" in out and "  top_k: 5\n" in out


def test_validate_env_checks_the_process_count(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny = str(CONFIGS[0].parent / "tiny_cpu.yaml")
    assert main(["config", "validate", tiny, "parallel.ep=2"]) == 0
    assert main(["config", "validate", tiny, "parallel.ep=2", "--env"]) == 2
    assert "this run has WORLD_SIZE=1" in capsys.readouterr().err


def test_train_refuses_before_starting_anything(capsys, tmp_path):
    tiny = str(CONFIGS[0].parent / "tiny_cpu.yaml")
    assert main(["train", tiny, "rollout.top_k=0", f"train.output_dir={tmp_path}/run"]) == 2
    assert "rollout.top_k=0 samples from no token" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_tensor_parallel_splits_must_divide_the_sizes():
    cfg = load_config(overrides=["parallel.tp=2", "model.vocab_size=513", "rollout.top_k=5"])
    assert config_problems(cfg).problems == [
        "model.vocab_size=513 must be divisible by the 2 tensor-parallel shards it is split into (parallel.tp/etp)"
    ]


def test_glm4_moe_format_rules():
    cfg = load_config(
        overrides=[
            "model.hf_architecture=Glm4MoeForCausalLM",
            "model.moe_shared_expert_intermediate_size=48",
            "model.moe_ffn_hidden_size=32",
            "model.moe_router_score_function=sigmoid",
            "model.moe_router_enable_expert_bias=true",
        ]
    )
    assert config_problems(cfg).problems == [
        (
            "model.moe_shared_expert_intermediate_size=48 must be a multiple of model.moe_ffn_hidden_size=32 (GLM-4.5 has "
            "n_shared_experts >= 1 of that width): the HF <-> Megatron bridge (weight sync to SGLang) cannot express it"
        )
    ]
