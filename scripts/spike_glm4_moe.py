"""Spike (issue 12 item 5): can the second MoE family run here? GLM-4.5 (``Glm4MoeForCausalLM``, GQA).

Two independent probes, each printing PASS/FAIL lines with the evidence:
  sglang   -- a tiny random Glm4MoeForCausalLM (sigmoid router + e_score_correction_bias, n_group /
              topk_group, 1 shared expert, first dense layer, partial rotary 0.5) written locally,
              served by SGLang 0.5.23's CPU engine; one /generate with return_routed_experts.
  megatron -- Megatron-Core 0.16.1 builds and runs the matching GPTModel on CPU (gloo, 1 rank):
              sigmoid + expert bias, grouped top-k, shared experts, dense-first, rotary_percent 0.5,
              qkv bias; forward + backward once.
Usage: python scripts/spike_glm4_moe.py {sglang,megatron} [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import httpx
import torch
from megatron.core.models.gpt import GPTModel
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from moe_rl.config import ExperimentConfig, ParallelConfig
from moe_rl.learner.cpu_shims import seed_model_parallel_rng
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.model import _layer_spec, forward_logits, transformer_config_from
from moe_rl.rollout.launcher import SGLangServer
from moe_rl.rollout.server_spec import ServerSpec
from moe_rl.tasks.tokenizer import build_task_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "use_qk_norm": False,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_tiny_glm4_moe(out: Path) -> Path:
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(architectures=["Glm4MoeForCausalLM"], **TINY)).float()
    with torch.no_grad():  # a non-zero score-correction bias, so the probe sees it used
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn_like(layer.mlp.gate.e_score_correction_bias))
    model.save_pretrained(out)
    build_task_tokenizer(TINY["vocab_size"]).save_pretrained(out)
    return out


def probe_sglang(out: Path) -> None:
    model_dir = write_tiny_glm4_moe(out / "glm4_moe")
    spec = ServerSpec(model_path=str(model_dir), dtype="float32", mem_fraction_static=0.3, startup_timeout_s=600)
    try:
        with SGLangServer(spec, log_path=out / "logs" / "sglang.log") as server:
            body = {
                "input_ids": [1, 20, 21, 5, 6, 7, 26],
                "return_routed_experts": True,
                "return_logprob": True,
                "sampling_params": {"temperature": 1.0, "top_k": 8, "max_new_tokens": 4},
            }
            reply = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
            meta = reply.get("meta_info", {})
            print("PASS sglang: generated", reply.get("output_ids"), "routed_experts" in meta and "routes returned")
    except Exception as exc:  # noqa: BLE001 -- the spike reports whatever stops it
        print(f"FAIL sglang: {type(exc).__name__}: {str(exc)[-3000:]}")


def probe_megatron() -> None:
    cfg = ExperimentConfig.model_validate(
        {
            "model": {
                "num_layers": 3,
                "hidden_size": 64,
                "ffn_hidden_size": 128,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "kv_channels": 16,
                "qk_layernorm": False,
                "vocab_size": 64,
                "seq_length": 64,
                "num_moe_experts": 16,
                "moe_router_topk": 4,
                "moe_ffn_hidden_size": 32,
                "moe_router_score_function": "sigmoid",
                "moe_router_enable_expert_bias": True,
                "moe_router_num_groups": 4,
                "moe_router_group_topk": 2,
                "moe_router_topk_scaling_factor": 2.5,
                "first_k_dense_layers": 1,
                "moe_router_load_balancing_type": "none",
            }
        }
    )
    init_distributed(ParallelConfig())

    tcfg = dataclasses.replace(transformer_config_from(cfg), moe_shared_expert_intermediate_size=32, add_qkv_bias=True)
    seed_model_parallel_rng(0)
    try:
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=_layer_spec(tcfg, False),
            vocab_size=64,
            max_sequence_length=64,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_percent=0.5,
            rotary_base=10000,
        )
        ids = torch.randint(0, 64, (2, 8))
        logits = forward_logits(model, ids)
        logits.float().pow(2).mean().backward()
        names = [n for n, _ in model.named_parameters() if "layers.1." in n]
        print("PASS megatron: logits", tuple(logits.shape), "layer-1 params:", names)
        print("     buffers:", [n for n, _ in model.named_buffers() if "expert_bias" in n])
    except Exception as exc:  # noqa: BLE001
        print(f"FAIL megatron: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("probe", choices=["sglang", "megatron"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="spike_glm4_"))
    probe_sglang(out) if args.probe == "sglang" else probe_megatron()
