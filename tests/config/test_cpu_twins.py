"""CPU twins (configs/cpu/<name>.yaml) differ from their cluster originals only where issue 12 allows,
and every difference is named in the twin's header comment."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.launch import build_launch_plan, sbatch_args

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TWINS = sorted((CONFIGS / "cpu").glob("*.yaml"))

# Issue 12's list: sizes, parallel layout, precision, rollout.device, engine flags that need a GPU,
# checkpoint.init_from_hf, step counts -- plus the twin's identity and the cluster allocation; and
# (issue 34) optimizer flags that need Transformer Engine.
MODEL_SIZES = {
    f"model.{k}"
    for k in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "vocab_size",
        "seq_length",
        "num_moe_experts",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
    )
}
BATCH_SIZES = {"rollout.max_new_tokens", "rollout.samples_per_prompt", "train.prompts_per_step"}
PARALLEL = {"parallel.tp", "parallel.ep", "parallel.etp", "parallel.pp", "parallel.cp"}
PRECISION = {"precision.params_dtype", "precision.fp8"}
GPU_ENGINE = {"rollout.device", "rollout.extra_server_args", "rollout.mem_fraction_static", "rollout.max_total_tokens"}
# Megatron-Core 0.16.1 refuses use_precision_aware_optimizer without Transformer Engine (optimizer_config.py
# __post_init__: is_te_min_version raises TypeError when TE is absent), even with optimizer_cpu_offload;
# optimizer_cpu_offload moves GPU state to the host, which moe_rl.learner.optimizer refuses without CUDA.
NEEDS_TE = {"optim.use_precision_aware_optimizer", "optim.optimizer_cpu_offload"}
STEPS = {"train.steps", "checkpoint.save_interval"}
CPU_MACHINE = {"rollout.startup_timeout_s"}  # issue 39: a CPU server on 2 loaded cores (a SLURM job) starts slowly
IDENTITY = {"name", "train.output_dir", "checkpoint.init_from_hf"}
ALLOWED = MODEL_SIZES | BATCH_SIZES | PARALLEL | PRECISION | GPU_ENGINE | NEEDS_TE | STEPS | IDENTITY | CPU_MACHINE


def allowed_key(key: str) -> str | None:
    """The allowed key ``key`` falls under (itself or a section of it, e.g. precision.fp8), else None."""
    return next((a for a in ALLOWED if key == a or key.startswith(a + ".")), None)


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "grid":
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def twin_differences(twin: Path, original: Path | None = None) -> dict[str, tuple]:
    """``{dotted key: (original value, twin value)}`` where the resolved configs differ."""
    a = flatten(load_config(original or CONFIGS / twin.name).model_dump())
    b = flatten(load_config(twin).model_dump())
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, ln in enumerate(lines) if not ln.startswith("#"))])


def test_each_cluster_config_has_a_twin():
    originals = {p.name for p in CONFIGS.glob("*.yaml") if "launch" in p.read_text() and "cuda" in p.read_text()}
    assert originals and originals <= {t.name for t in TWINS}


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_twin_differs_only_in_allowed_keys_each_named_in_its_header(twin):
    diffs = twin_differences(twin)
    outside = {k: v for k, v in diffs.items() if allowed_key(k) is None and not k.startswith("launch.")}
    assert outside == {}, f"{twin.name} changes features, not only sizes/layout: {outside}"
    text = header(twin)
    named = {allowed_key(k) for k in diffs if not k.startswith("launch.")}
    unnamed = sorted(k for k in named if k.split(".")[-1] not in text)
    assert unnamed == [], f"{twin.name}'s header does not name {unnamed}"
    assert "launch.*" in text or not any(k.startswith("launch.") for k in diffs)


def test_the_twin_diff_catches_a_feature_change(tmp_path):
    twin = TWINS[0]
    changed = tmp_path / twin.name
    text = twin.read_text().replace(f"extends: ../{twin.name}", f"extends: {CONFIGS / twin.name}")
    changed.write_text(text.replace("replay:", "replay_unused:") + "replay:\n  routing: r2\n")
    diffs = twin_differences(changed, CONFIGS / twin.name)
    assert diffs["replay.routing"] == ("r3", "r2") and allowed_key("replay.routing") is None


@pytest.mark.parametrize("twin", TWINS, ids=lambda p: p.stem)
def test_twin_launch_fits_the_local_slurm_cluster_as_shipped(twin):
    """Issue 39: node1..node3 with CPUs=1 RealMemory=7000 Gres=gpu:8 each (scripts/slurm_local.sh): the twin's job
    asks for 3 nodes, a GPU count a node has, no CPUs per task and no memory, and runs its 2 learner ranks one per
    learner node (the model parallelism of test_cpu_twin_runs: ep=2, or pp=2 for the 235B twin)."""

    cfg = load_config(twin)
    args = sbatch_args(cfg)
    assert "--nodes=3" in args and "--gpus-per-node=1" in args and "--ntasks-per-node=1" in args
    assert not [a for a in args if a.startswith(("--mem", "--cpus-per-task", "--gres"))]
    plan = build_launch_plan(cfg, {"SLURM_JOB_NODELIST": "node[1-3]", "SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "1"})
    assert [s.nodes for s in plan.rollout_steps] == [("node1",)] and plan.learner_step.nodes == ("node2", "node3")
    assert "--nproc-per-node=1" in plan.learner_step.command
    assert cfg.parallel.ep * cfg.parallel.pp == 2 and plan.init_hf  # no HF checkpoint: the job writes one
