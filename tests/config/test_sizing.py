"""The job plan (moe_rl.sizing): its new terms on hand-checked cases, the refusals, the shipped configs, the CLI.

Hand checks use Qwen3-30B-A3B's published shape (configs/qwen3_30b_a3b.yaml: hidden 2048, 48 layers, 32 query
heads, 4 query groups, head dim 128, 128 experts of ffn 768, vocab 151936) at the shipped layout tp 4, ep 8,
etp 1, 32 GPUs: the expected figures below are written out from that shape, not from the plan's helpers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_rl.cli import main
from moe_rl.config import load_config
from moe_rl.preflight import config_problems
from moe_rl.sizing import job_fits, job_plan
from moe_rl.sizing.terms import CUDA_NCCL_OVERHEAD

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
Q30, Q235 = CONFIGS / "qwen3_30b_a3b.yaml", CONFIGS / "qwen3_235b_a22b.yaml"
SHIPPED = sorted(CONFIGS.glob("*.yaml")) + sorted((CONFIGS / "cpu").glob("*.yaml"))
H, VOCAB, LAYERS, TP = 2048, 151936, 48, 4
# per layer and rank: qkv [128*(32+2*4), 2048] + proj [2048, 32*128], split over tp 4; 128/8 = 16 experts of
# fc1 [2*768, 2048] + fc2 [2048, 768] (etp 1)
ATTENTION = (128 * 40 * H + 32 * 128 * H) // TP
EXPERTS = 16 * 3 * H * 768
LINEAR_30B = LAYERS * (ATTENTION + EXPERTS)  # 3,850,371,072 elements: 7.70 GB of FP8 caches at 2 B


def test_fp8_caches_are_two_bytes_per_linear_weight():
    """TE keeps a row-wise and a column-wise FP8 copy (1 B + 1 B) of each linear weight; not the embedding,
    output layer, norms or router. Off without FP8 or with disable_parameter_transpose_cache."""
    plan = job_plan(load_config(Q30))
    assert plan.worst.gpu["fp8_cache"] == 2 * LINEAR_30B
    off = job_plan(load_config(Q30, ["precision.fp8.disable_parameter_transpose_cache=true"]))
    assert off.worst.gpu["fp8_cache"] == 0
    assert plan.worst.gpu_total - off.worst.gpu_total == 2 * LINEAR_30B
    assert job_plan(load_config(Q30, ["precision.fp8=null"])).worst.gpu["fp8_cache"] == 0


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_logits_are_eighteen_bytes_per_element_at_the_micro_batch_tokens(micro_batch):
    """bf16 logits (2) + fp32 z, shifted, exp, exp*shifted (4 x 4) = 18 B per element of
    micro_batch x (prompt + max_new_tokens) tokens x vocab / tp: with no data section a prompt may take the
    rest of seq_length, so 32768 tokens a sample."""
    cfg = load_config(Q30, [f"train.micro_batch_size={micro_batch}"])
    assert job_plan(cfg).worst.gpu["logits"] == micro_batch * 32768 * (VOCAB / TP) * 18
    assert job_plan(cfg).worst.gpu["overhead"] == CUDA_NCCL_OVERHEAD == 3e9


def test_hf_import_peak_is_the_largest_transient_copy_and_the_share_is_read_not_held():
    """30B rank: bf16 file and bf16 params (no cast copy). Whole tensors come from the mapped file (page cache);
    the tp-split vocabulary shard (151936 x 2048 / 4 elements) is a sliced copy, 2 B each, larger than the packed
    qkv (parts and concatenation, 40 x 128 x 2048 / 4 x 4 B) or an expert's fc1 (2 x 768 x 2048 x 2 B). The rank's
    own 0.39B dense + 3.62B expert params are read (disk line: bf16), not held. The save buffer (the vocabulary
    shard in fp32) is larger than the import; a node holds 8. Plus 2 KiB kept per HF tensor read (measured) of
    48 layers x (q, k, v, o, 2 norms, q/k norms, router, 16 local experts x 3) + embedding, final norm, output."""
    plan = job_plan(load_config(Q30))
    r = plan.worst_host
    own = LINEAR_30B + LAYERS * (2 * H + 2 * 128 + 128 * H) + 2 * VOCAB * H // TP + H
    reads = LAYERS * (8 + 1 + 16 * 3) + 3
    assert r.host["hf_import"] == 2 * (VOCAB * H // TP) + 2048 * reads
    assert r.hf_read_bytes == 2 * own
    assert r.host["checkpoint_buffer"] == 4 * (VOCAB * H // TP)
    assert r.host_total == r.host["records"] + r.host["checkpoint_buffer"]  # never both at once
    assert r.host["offloaded_optimizer"] == 0  # 30B keeps its optimizer on the GPU
    fp32 = job_plan(load_config(Q30, ["precision.params_dtype=float32", "precision.fp8=null"])).worst_host
    assert fp32.host["hf_import"] == (2 + 4) * (VOCAB * H // TP) + 2048 * reads  # the slice and its fp32 cast


def test_records_and_save_times_by_hand():
    """30B step: 64 prompts x 8 samples of 32768 tokens: int32 ids (4 x 32768) + fp32 log-prob and int32 version
    per response token (8 x 8192) + r3 routes, uint8 for 128 experts (32767 x 48 MoE layers x top-8); each of
    dp 8 ranks reads μ and versions of every sample and 1/8 of the rest (records format 3). A 235B node saves
    8 x its rank's 51.5 GB at 2 GB/s: 206 s."""
    plan = job_plan(load_config(Q30))
    own = 4 * 32768 + 32767 * 48 * 8
    assert plan.worst_host.host["records"] == 64 * 8 * (8 * 8192 + own / 8)
    lines = job_plan(load_config(Q235)).lines()
    (save,) = [line for line in lines if line.strip().startswith("checkpoint save")]
    assert "411.7 GB" in save and "206 s at launch.fs_bandwidth_gb_s=2" in save
    lines = job_plan(load_config(Q235, ["launch.fs_bandwidth_gb_s=4"])).lines()
    assert any("103 s at launch.fs_bandwidth_gb_s=4" in line for line in lines)


def test_235b_on_256_gb_hosts_is_refused_naming_the_offloaded_optimizer():
    problems = config_problems(load_config(Q235, ["launch.host_memory_gb=256"])).problems
    (msg,) = [p for p in problems if p.startswith("launch.host_memory_gb=256")]
    assert "offloaded optimizer 470.5 GB" in msg and "launch.learner_nodes=16 gives" in msg
    assert "optim.optimizer_offload_fraction=0.5 gives" in msg
    assert list(job_fits(load_config(Q235, ["launch.host_memory_gb=1024"]))) == []


def test_235b_with_the_fp8_transpose_cache_is_refused_naming_the_flag():
    cfg = load_config(Q235, ["precision.fp8.disable_parameter_transpose_cache=false"])
    (msg,) = [p for p in config_problems(cfg).problems if p.startswith("launch.gpu_memory_gb=80")]
    assert "the fullest GPU needs 95.0 GB" in msg and "FP8 caches 15.9 GB" in msg
    assert "precision.fp8.disable_parameter_transpose_cache=true gives 79.1 GB;" in msg


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_config_fits_its_gpus(path):
    cfg = load_config(path)
    assert list(job_fits(cfg)) == []
    assert job_plan(cfg).worst.gpu_total <= cfg.launch.gpu_memory_gb * 1e9


def test_every_shipped_config_passes_config_validate(capsys):
    assert main(["config", "validate", *map(str, SHIPPED)]) == 0
    # math_cpu, agent_cpu: no plan until their models are built (make math-example / agent-example)
    assert capsys.readouterr().out.count("GPU total") >= len(SHIPPED) - 2


def test_plan_cli_prints_gpu_host_disk_and_network(capsys, monkeypatch):
    assert main(["plan", str(Q235)]) == 0
    out = capsys.readouterr().out
    for words in (
        "FP8 caches",
        "logits               22.4 GB (32768 tokens",
        "GPU total            79.1 GB of launch.gpu_memory_gb=80",
        "host per rank | per node (8 GPUs):",
        "offloaded optimizer    58.8 GB |    470.5 GB",
        "disk per rank | per node (8 GPUs):",
        "checkpoint save",
        "network per step:",
        "[GPU check pending]",
    ):
        assert words in out
    assert main(["plan", str(Q235), "launch.host_memory_gb=256"]) == 2
    assert "offloaded optimizer 470.5 GB" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-12]")
    assert main(["launch", str(Q235), "--dry-run"]) == 0
    script = capsys.readouterr().out
    for words in (
        "#   FP8 caches",
        "#   GPU total",
        "# host per rank | per node",
        "# disk per rank",
        "# network per step",
    ):
        assert words in script
