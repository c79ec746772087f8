"""CI gate of ``rollout.true_on_policy``: a real SGLang CPU server + the Megatron-Core learner, 2 steps.

With ``train.minibatches_per_step: 1`` π_old is the rollout's policy, so the learner's recomputed
log-probs must equal the server's recorded ones exactly: ``offpolicy/log_ratio_abs_max == 0.0`` and
``offpolicy/kl_k3 == 0.0`` (no tolerance), and the learner's natural top-k must equal the recorded
routes at every layer and position: both ``replay/rollout_vs_natural/{prompt,response}/flip_rate``
are 0.0 at every step. Later rollouts come from weights pushed through the weight sync: tensor (tiny,
ep=1, async), distributed (tiny, ep=2) and disk (cpu_midsize in bf16) -- one transport per run. In the
async run a batch may be one version stale, so its tokens are checked against the version that generated
them (the learner at that version recomputes them offline). Each run
is a ``moe-rl train`` subprocess as a user runs it; the two tiny runs (1 and 2 ranks) share one
true-on-policy server of the session (tests/exact/conftest.py; ``moe-rl certify``'s test uses it too) through
``rollout.addresses``, each pushing its own weights at its start.

The check can fail: ``test_one_stock_kernel_breaks_equality`` recomputes step 0's saved records with
the exact learner (bit-equal) and with one kernel swapped back to Megatron's stock one (non-zero).

Keep Sampling Mask: tiny_cpu as shipped (KSM on, top-p 0.95, top-k 20, R3) in fp32 on the same server,
2 sync steps: the kept-set log-probs (``output_token_sampling_logprobs``, the rollout's μ under KSM) come
from ``kernels.kept_token_logprobs`` on both sides; the learner's stock renormalisation
(``keep_mask_logprobs``) on the same exact logits is shown not to be bit-equal.

Pipeline and tensor parallelism: one 2-rank worker run (``parallel_exact_worker.py``) recomputes step 0's records
of the async run with the learner at pp=2 (exact; not with stock SDPA on one stage) and at tp=2 (equal to the tp=1
learner whose row-parallel linears split K into the same 2 blocks, TBIK; not to the unsplit tp=1 server).

Kernel identity guard: a learner forced onto ATen's ``default`` CPU kernels against the same server refuses
step 0's records, naming both identities (``moe_rl.exact.identity``); so does one forced onto another MKL code
path (``MKL_ENABLE_INSTRUCTIONS=AVX2``), while this process, on the server's settings, loads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter
from safetensors import safe_open

from moe_rl.config import load_config
from moe_rl.exact import kernels
from moe_rl.exact.identity import EXTRA_KEY, learner_identity, served_identities
from moe_rl.exact.kernels import kept_token_logprobs
from moe_rl.learner.hf_convert import export_hf_state_dict
from moe_rl.learner.hf_export import write_hf_checkpoint
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.model import build_model, forward_logits
from moe_rl.records import RolloutBatch
from moe_rl.replay.keep_mask import KeptSets, keep_mask_logprobs, kept_mask
from moe_rl.source.step_records import StepRecords
from moe_rl.train.metrics_log import read_metrics
from tests.conftest import run_to_file
from tests.distributed.torchrun import run_worker
from tests.exact.conftest import GATE

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).parents[2]
EXACT_KEYS = (
    "offpolicy/log_ratio_abs_max",
    "offpolicy/kl_k3",
    "replay/rollout_vs_natural/prompt/flip_rate",
    "replay/rollout_vs_natural/response/flip_rate",
)


def _train(out_dir: Path, config: str, *overrides: str, nproc: int = 1) -> list[dict]:
    args = [str(ROOT / "configs" / config), *GATE, f"train.output_dir={out_dir}", *overrides]
    if nproc == 1:
        cmd = [sys.executable, "-m", "moe_rl.cli", "train", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            "-m",
            "moe_rl.cli",
            "train",
            *args,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc, output = run_to_file(cmd, out_dir.parent / f"{out_dir.name}.console.txt", timeout=600, env=env)
    assert proc.returncode == 0, f"moe-rl train failed:\n{output[-4000:]}"
    return read_metrics(out_dir / "metrics.jsonl")


def _assert_exact(metrics: list[dict], steps=(1, 2)) -> None:
    assert [m["step"] for m in metrics] == list(steps)
    for m in metrics:
        got = {k: m[k] for k in EXACT_KEYS}
        assert all(v == 0.0 for v in got.values()), f"step {m['step']}: not exact: {got}"


ASYNC = [
    "train.rollout_mode=async",
    "train.max_staleness=1",
    "train.steps=3",
    "checkpoint.save_interval=1",
    "checkpoint.keep_last=3",
]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_server):
    """tiny, ep=1, async (max_staleness 1), tensor sync, 3 steps: batches of versions 0, 0 and 1."""
    out = tmp_path_factory.mktemp("tiny_exact")
    return out, _train(out, "tiny_cpu.yaml", "replay.routing=none", f"rollout.addresses=[{tiny_server}]", *ASYNC)


def _policy(out: Path, version: int):
    """The learner at weight version ``version``: the initial model (same seed) or the step-``version``
    checkpoint (one rank: whole tensors, Megatron names)."""

    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", overrides=GATE[:4])
    model = build_model(cfg).eval()
    if version:
        with safe_open(out / "checkpoints" / f"step_{version:08d}" / "model-r00000.safetensors", "pt") as f:
            state = {key.split("@")[0]: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (safe_open)
        missing, _ = model.load_state_dict(state, strict=False)
        assert not [m for m in missing if not m.endswith("_extra_state")], missing
    return model, cfg.rollout.temperature


def _recompute(model, sample, temperature: float):
    """The learner's log-prob of every response token and its natural top-k (sorted) per MoE layer at every
    input position of ``sample``."""

    tokens = torch.as_tensor(list(sample.prompt_ids) + list(sample.response_ids), dtype=torch.long)[None]
    routes = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: routes.append(out[1]))
        for m in model.modules()
        if isinstance(m, TopKRouter)
    ]
    try:
        with torch.no_grad():
            logp, _ = response_logprobs(
                model, tokens[:, :-1], tokens[:, 1:], temperature=temperature, with_entropy=False
            )
    finally:
        for h in hooks:
            h.remove()
    top = torch.stack([m.nonzero()[:, 1].view(m.shape[0], -1) for m in routes], dim=1)  # [positions, L, k]
    return logp[0, len(sample.prompt_ids) - 1 :], top


def test_tiny_fp32_ep1_async_is_exact_against_each_version(tiny_run, megatron_world):
    """Async: step 1 trains a fresh batch, so the logged metrics are exactly 0.0; later batches are one version
    stale, so the learner's metrics (its current policy against the stale one) are not, and each token is
    checked against the weights that generated it: the learner at that version recomputes every log-prob
    and every layer's top-k at every position bit for bit (the version-1 weights reached the server through
    the tensor sync)."""
    out, metrics = tiny_run
    assert [m["step"] for m in metrics] == [1, 2, 3]
    _assert_exact(metrics[:1], steps=[1])
    seen = set()
    for step in (1, 2):
        samples = RolloutBatch.load(out / "rollouts" / f"step_{step:06d}.safetensors").samples()
        versions = {int(v) for s in samples for v in s.token_versions}
        assert len(versions) == 1, versions  # partial rollouts off: one version per batch
        seen |= versions
        model, temperature = _policy(out, versions.pop())
        for s in samples:
            logp, top = _recompute(model, s, temperature)
            assert torch.equal(logp, torch.as_tensor(s.rollout_logp, dtype=torch.float32)), (step, s.group_id)
            assert torch.equal(top, torch.as_tensor(s.routes.astype("int64")).sort(-1).values), (step, s.group_id)
    assert seen & {1, 2}, seen  # (normally {0, 1}) weights that reached the server through the tensor sync


def test_midsize_bf16_top8_disk_sync_is_exact(tmp_path):
    """configs/cpu_midsize.yaml (6 layers, 64 experts, top-8: the combine order and its fp32 accumulation
    matter) in its shipped bf16 on both sides, weights synced through files, with replay.routing=none, which
    still logs the flip metrics; no warm start (the gate is about the kernels, not the policy)."""
    _assert_exact(
        _train(
            tmp_path,
            "cpu_midsize.yaml",
            "train.warm_start=null",
            "rollout.dtype=bfloat16",
            "precision.params_dtype=bfloat16",
            "rollout.weight_sync=disk",
        )
    )


@pytest.mark.distributed
def test_tiny_fp32_ep2_with_r3_distributed_sync_is_exact(tmp_path, tiny_server):
    """Two learner ranks, experts split over them (all-to-all dispatch), R3 replaying the recorded routes,
    weights broadcast to the server through a weight-update group (gloo)."""
    _assert_exact(
        _train(
            tmp_path,
            "tiny_cpu.yaml",
            "replay.routing=r3",
            "parallel.ep=2",
            "rollout.weight_sync=distributed",
            f"rollout.addresses=[{tiny_server}]",
            nproc=2,
        )
    )


def _stock_attention(q, k, v, start):
    """torch's causal SDPA over whole sequences (the learner calls the kernel with ``start=0``)."""
    assert start == 0
    rep = q.shape[1] // k.shape[1]
    kv = [t.float().repeat_interleave(rep, 1).transpose(0, 1) for t in (k, v)]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), *kv, is_causal=True)
    return out.transpose(0, 1).to(q.dtype)


def test_one_stock_kernel_breaks_equality(tiny_run, megatron_world, monkeypatch):
    """Step 0's records, recomputed by the step-0 learner: exact spec -> equal; one stock kernel -> not."""

    out, _ = tiny_run
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", overrides=GATE[:4])
    samples = RolloutBatch.load(out / "rollouts" / "step_000000.safetensors").samples()

    def max_abs_diff(model) -> float:
        worst = 0.0
        for s in samples:
            tokens = torch.as_tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)[None]
            P = len(s.prompt_ids)
            with torch.no_grad():
                logp, _ = response_logprobs(
                    model, tokens[:, :-1], tokens[:, 1:], temperature=cfg.rollout.temperature, with_entropy=False
                )
            recorded = torch.as_tensor(s.rollout_logp, dtype=torch.float32)
            worst = max(worst, (logp[0, P - 1 :] - recorded).abs().max().item())
        return worst

    model = build_model(cfg).eval()  # the trainer's initial weights (same seed): step 0's policy
    assert max_abs_diff(model) == 0.0
    # the attention back to torch's stock SDPA (not a linear or a norm: in fp32 the tiled-GEMM linear kernel and
    # the stock BLAS matmul round alike on one whole sequence, and so do torch's RMSNorm and the kernel's)
    monkeypatch.setattr(kernels, "attention", _stock_attention)
    assert max_abs_diff(model) > 0.0


WORKER = Path(__file__).with_name("parallel_exact_worker.py")


@pytest.fixture(scope="module")
def parallel_recompute(tiny_run, megatron_world, tmp_path_factory) -> tuple[list[dict], int]:
    """Step 0's records of the tiny async run recomputed by one 2-rank worker run at pp=2, then tp=2, then tp=1
    (parallel_exact_worker.py); (each rank's report, the records' response tokens). The step-0 weights reach the
    worker as an HF export, imported per rank."""
    out, _ = tiny_run
    tmp = tmp_path_factory.mktemp("parallel_exact")
    cfg = load_config(ROOT / "configs/tiny_cpu.yaml", overrides=GATE[:4])
    hf = write_hf_checkpoint(export_hf_state_dict(build_model(cfg).eval(), cfg.model), cfg.model, tmp / "hf")
    records = out / "rollouts" / "step_000000.safetensors"
    run_worker(WORKER, str(hf), str(records), str(tmp), timeout=300)
    tokens = sum(len(x.response_ids) for x in RolloutBatch.load(records).samples())
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)], tokens


def _assert_matches_records(run: dict, tokens: int) -> None:
    assert len(run["logp"]) == tokens
    assert run["log_ratio_abs_max"] == 0.0 and run["kl_k3"] == 0.0, {k: run[k] for k in ("log_ratio_abs_max", "kl_k3")}
    assert set(run["flips"].values()) == {0}, run["flips"]


@pytest.mark.distributed
def test_a_pp2_learner_recomputes_the_records_exactly_and_one_stock_kernel_on_one_stage_breaks_it(parallel_recompute):
    """The learner at pp=2 (2 ranks, one decoder layer per stage, Megatron's 1F1B schedule, the trainer's
    log-prob pass over padded microbatches) with the step-0 weights recomputes step 0's records of the tp=1
    server bit for bit: log_ratio_abs_max and kl_k3 exactly 0, no route differs on either stage's MoE layer.
    With the attention swapped back to stock SDPA on the last stage only, its log-probs differ while stage 0's
    routes stay equal."""
    ranks, tokens = parallel_recompute
    assert [sorted(r["pp2"]["flips"]) for r in ranks] == [["0"], ["1"]]  # each stage its own MoE layer
    for r in ranks:
        _assert_matches_records(r["pp2"], tokens)
    broken = [r["pp2_stock_attention_on_stage_1"] for r in ranks]
    assert broken[0]["log_ratio_abs_max"] == broken[1]["log_ratio_abs_max"] > 0.0, broken
    assert broken[0]["flips"] == {"0": 0}, broken  # stage 0 kept the contract


@pytest.mark.distributed
def test_a_tp2_learner_equals_the_tp1_kernel_split_in_the_same_fixed_blocks(parallel_recompute):
    """TBIK: the learner at tp=2 (sequence parallel, etp=1) gives every log-prob and route of the tp=1 exact
    learner whose row-parallel linears split K into the same 2 blocks and combine them in the same order
    (``kernels.linear(tp_blocks=2)``), bit for bit; the tp=1 learner without the split is the server's (the
    records, exactly), and the tp=2 learner is not (the server does not split its reductions)."""
    ranks, tokens = parallel_recompute
    for r in ranks:
        _assert_matches_records(r["tp1"], tokens)
        assert r["tp2"]["logp"] == r["tp1_blocks2"]["logp"]
        assert r["tp2"]["routes"] == r["tp1_blocks2"]["routes"]
        assert r["tp2"]["log_ratio_abs_max"] > 0.0, r["tp2"]["log_ratio_abs_max"]


@pytest.mark.distributed
def test_a_tp2_step_keeps_the_expert_replicas_equal_and_counts_them_once_in_the_grad_norm(parallel_recompute):
    """At tp=2, etp=1, ep=1 both tp ranks hold every expert and each trains it on its own half of the sequence:
    their gradients must be summed over the expert-data-parallel group (``optimizer._mark_replicated_experts``;
    Megatron's ``allreduce`` attribute routes experts there only at ep > 1), or the replicas drift apart from the
    first step. After one step on the same batch: every expert weight equal on both ranks, and the grad norm that
    of the tp=1 learner (data parallel over the same batch) up to the backward's rounding."""
    ranks, _ = parallel_recompute
    for r in ranks:
        assert r["train_tp2"]["expert_replica_diff"] == 0.0, r["train_tp2"]
        tp2, tp1 = r["train_tp2"]["grad_norm"], r["train_tp1"]["grad_norm"]
        assert tp2 == pytest.approx(tp1, rel=1e-6), (tp2, tp1)  # unfixed: 1.2e-5 apart


@pytest.fixture(scope="module")
def ksm_run(tmp_path_factory, tiny_server):
    """tiny_cpu as shipped (KSM on, top-p 0.95, top-k 20, R3) + the gate's fp32 true-on-policy settings, ep=1,
    sync, 2 steps, on the module's server (its own weights pushed at its start)."""
    out = tmp_path_factory.mktemp("tiny_ksm_exact")
    return out, _train(out, "tiny_cpu.yaml", "replay.keep_sampling_mask=true", f"rollout.addresses=[{tiny_server}]")


def test_tiny_fp32_keep_sampling_mask_with_top_p_and_top_k_is_exact(ksm_run, megatron_world):
    """The four metrics are 0.0 at both steps with the learner renormalising over the rollout's kept sets;
    step 0's kept sets are real truncations (1..20 of 64 ids), and recomputed offline by the step-0 learner the
    kept-set log-probs equal the server's through the shared kernel but not through the stock renormalisation
    (``keep_mask_logprobs``: the same sum, in another order) on the same logits."""
    out, metrics = ksm_run
    _assert_exact(metrics)
    model, temperature = _policy(out, 0)
    samples = RolloutBatch.load(out / "rollouts" / "step_000000.safetensors").samples()
    sizes = [len(m) for s in samples for m in s.sampling_mask]
    assert 1 <= min(sizes) and max(sizes) <= 20 < model.vocab_size, sizes
    stock_worst = 0.0
    for s in samples:
        tokens = torch.as_tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)[None]
        with torch.no_grad():
            logits = forward_logits(model, tokens[:, :-1])[0, len(s.prompt_ids) - 1 :]
        targets = tokens[0, len(s.prompt_ids) :]
        kept = KeptSets.from_lists([m.tolist() for m in s.sampling_mask])
        mu = torch.as_tensor(s.sampling_logp, dtype=torch.float32)
        shared = kept_token_logprobs(logits, kept_mask(kept, logits.shape[-1]), targets, temperature)
        assert torch.equal(shared, mu), (s.group_id, (shared - mu).abs().max().item())
        stock = keep_mask_logprobs(logits, targets, kept, temperature).logp
        stock_worst = max(stock_worst, (stock - mu).abs().max().item())
    assert stock_worst > 0.0


def test_a_learner_on_another_cpu_capability_refuses_the_batch_naming_both_identities(tmp_path, tiny_server):
    """The kernel identity guard: a learner forced onto ATen's ``default`` CPU kernels (ATEN_CPU_CAPABILITY, read
    at torch's start) against the module's server on this machine's own capability. First the two identities are
    shown to differ (the server's from its endpoint, the learner's from a process with the variable set); then
    ``moe-rl train`` with the variable refuses step 0's records with one line naming both."""
    served = served_identities([tiny_server])[tiny_server]
    if served["cpu_capability"] == "DEFAULT":
        pytest.skip("this machine's torch already runs the default CPU kernels: no other capability to force")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    probe = (
        "import json, sys; from moe_rl.config import load_config; from moe_rl.exact.identity import learner_identity; "
        "print(json.dumps(learner_identity(load_config(sys.argv[1], sys.argv[2:]))))"
    )
    cfg_args = [str(ROOT / "configs" / "tiny_cpu.yaml"), *GATE]
    out = subprocess.run([sys.executable, "-c", probe, *cfg_args], env=env, capture_output=True, text=True, check=True)
    learner = json.loads(out.stdout.strip().splitlines()[-1])
    here = learner_identity(load_config(ROOT / "configs" / "tiny_cpu.yaml", GATE))
    assert learner["cpu_capability"] == "DEFAULT" and served == here  # the server agrees with an unforced learner
    assert {k for k in served if served[k] != learner[k]} == {"cpu_capability"}
    cmd = [sys.executable, "-m", "moe_rl.cli", "train", *cfg_args, f"train.output_dir={tmp_path / 'run'}"]
    cmd.append(f"rollout.addresses=[{tiny_server}]")
    proc, output = run_to_file(cmd, tmp_path / "console.txt", timeout=600, env=env)
    assert proc.returncode != 0
    named = f"cpu_capability: server {served['cpu_capability']!r} vs learner 'DEFAULT'"
    line = next((x for x in output.splitlines() if "made under another kernel identity" in x), "")
    assert named in line and "step_000000.safetensors" in line and f"server {tiny_server}" in line, output[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run" / "metrics.jsonl")


def test_a_learner_on_another_mkl_code_path_refuses_the_batch_and_one_on_the_same_loads_it(tiny_run, tiny_server):
    """The guard's MKL keys: MKL picks its instruction set at run time, apart from ATen's capability
    (``MKL_ENABLE_INSTRUCTIONS=AVX2`` moves 80% of tiny's fp32 logits here; docs/true_on_policy.md). A learner
    process with that variable loads the async run's step-0 records (stamped with the server's identity) as
    ``moe-rl train`` does (``StepRecords.for_trainer(...).load``): its identity is first shown to differ from the
    server's, only in ``mkl_isa``; then the load is refused with one line naming both. This process, on the
    server's settings, loads the same records."""
    out, _ = tiny_run
    records = out / "rollouts" / "step_000000.safetensors"
    served = served_identities([tiny_server])[tiny_server]
    assert list(RolloutBatch.load(records).extra[EXTRA_KEY].values()) == [served]
    probe = (
        "import json, sys\nfrom moe_rl.config import load_config\nfrom moe_rl.exact.identity import learner_identity\n"
        "from moe_rl.records import RecordError\nfrom moe_rl.source.step_records import StepRecords\n"
        "cfg = load_config(sys.argv[1], sys.argv[3:])\nprint(json.dumps(learner_identity(cfg)))\n"
        "try:\n    StepRecords.for_trainer(cfg, 'probe').load(sys.argv[2])\n    print('LOADED')\n"
        "except RecordError as exc:\n    print('REFUSED', exc)\n"
    )
    cfg_args = [str(ROOT / "configs" / "tiny_cpu.yaml"), str(records), *GATE]
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", probe, *cfg_args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ident, verdict = proc.stdout.strip().splitlines()[-2:]
    learner = json.loads(ident)
    if learner["mkl_isa"] == served["mkl_isa"]:
        pytest.skip("MKL already runs its AVX2 path here: no other MKL code path to force")
    assert {k for k in served.keys() | learner.keys() if served.get(k) != learner.get(k)} == {"mkl_isa"}
    named = f"mkl_isa: server {served['mkl_isa']!r} vs learner {learner['mkl_isa']!r}"
    assert verdict.startswith("REFUSED ") and "made under another kernel identity" in verdict, proc.stdout[-3000:]
    assert named in verdict and "step_000000.safetensors" in verdict and f"server {tiny_server}: {{" in verdict
    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", GATE)
    assert learner_identity(cfg) == served
    assert StepRecords.for_trainer(cfg, "probe").load(records).samples()  # the same records, loaded
