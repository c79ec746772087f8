"""Config sections of the learner's model and its layout: ``model``, ``parallel``, ``precision`` (with ``fp8``).

Field names mirror Megatron-Core's ``TransformerConfig`` where one exists, so a Megatron user reads them
without a glossary. ``model`` fills the keys not given explicitly from ``model.hf_path/config.json``
(``moe_rl.config.hf_model``). Each section checks itself; rules across sections live in
``moe_rl.config.schema``. It must not import torch or Megatron.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moe_rl.config.hf_model import HFModelError, model_keys_from_hf, read_hf_config
from moe_rl.config.section import Section

__all__ = ["FP8Config", "ModelConfig", "ParallelConfig", "PrecisionConfig"]


class FP8Config(Section):
    """Transformer Engine FP8 training (GPU only; rejected at build time without TE)."""

    format: Literal["e4m3", "hybrid"] = "e4m3"
    recipe: Literal["delayed", "tensorwise", "blockwise"] = "blockwise"
    amax_history_len: int = Field(1024, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    param_gather: bool = False
    disable_parameter_transpose_cache: bool = Field(
        False,
        description="Megatron's TransformerConfig flag: TE re-quantises every weight at each micro-batch instead of "
        "keeping row- and column-wise FP8 copies (~2 bytes per parameter of GPU memory; moe_rl.sizing)",
    )


class ModelConfig(Section):
    """Decoder-only MoE transformer (Qwen3-MoE / DeepSeek-V3 family), Megatron names.

    With ``hf_path`` every architecture key not given explicitly is read from ``hf_path/config.json``
    (``moe_rl.config.hf_model``); an explicit key that disagrees is refused by the preflight.
    """

    hf_path: str | None = Field(
        None, description="Hugging Face model directory: architecture (config.json), initial weights and tokenizer"
    )
    build_command: str | None = Field(
        None,
        description="the command that creates model.hf_path on a fresh clone (e.g. 'make math-example'): "
        "config validate names it and checks the rest while the directory is missing; not part of the architecture",
    )
    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=1)
    ffn_hidden_size: int = Field(128, ge=1, description="dense MLP width (dense layers only)")
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int = Field(2, ge=1, description="GQA key/value heads")
    kv_channels: int = Field(16, ge=1, description="head dim")
    qk_layernorm: bool = True
    vocab_size: int = Field(512, ge=2)
    seq_length: int = Field(256, ge=2, description="max positions (prompt + response)")
    rotary_base: float = Field(1_000_000.0, gt=0)
    rotary_percent: float = Field(
        1.0, gt=0, le=1, description="fraction of each head dim that gets RoPE (GLM-4.5: 0.5)"
    )
    add_qkv_bias: bool = Field(False, description="bias on the q/k/v projections (GLM-4.5: true)")
    layernorm_epsilon: float = Field(1e-6, gt=0)
    init_method_std: float = Field(0.02, gt=0)
    num_moe_experts: int = Field(8, ge=1)
    moe_router_topk: int = Field(2, ge=1)
    moe_ffn_hidden_size: int = Field(32, ge=1)
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: int | None = Field(None, ge=1)
    moe_router_group_topk: int | None = Field(None, ge=1)
    moe_router_topk_scaling_factor: float | None = Field(None, gt=0)
    moe_router_dtype: Literal["fp32", "fp64"] | None = None
    moe_aux_loss_coeff: float = Field(0.0, ge=0)
    moe_z_loss_coeff: float | None = Field(None, ge=0)
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "sinkhorn", "none"] = "aux_loss"
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    moe_expert_capacity_factor: float | None = Field(None, gt=0)
    moe_router_fusion: bool = False
    moe_layer_freq: int | list[Literal[0, 1]] = 1
    first_k_dense_layers: int = Field(0, ge=0)
    mtp_num_layers: int = Field(0, ge=0)
    moe_shared_expert_intermediate_size: int | None = Field(None, ge=1, description="shared experts' total width")
    hf_architecture: Literal["Qwen3MoeForCausalLM", "Glm4MoeForCausalLM"] = Field(
        "Qwen3MoeForCausalLM", description="HF format for init_from_hf and weight sync to SGLang"
    )

    def moe_layer_pattern(self) -> list[int]:
        """Per decoder layer 1 = MoE, 0 = dense, combining moe_layer_freq and first_k_dense_layers."""
        if isinstance(self.moe_layer_freq, list):
            pattern = list(self.moe_layer_freq)
        else:
            pattern = [1 if i % self.moe_layer_freq == 0 else 0 for i in range(self.num_layers)]
        for i in range(min(self.first_k_dense_layers, self.num_layers)):
            pattern[i] = 0
        return pattern

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern())

    @model_validator(mode="before")
    @classmethod
    def _fill_from_hf(cls, data):
        """Keys not given explicitly come from ``hf_path/config.json`` (unreadable: the preflight says why)."""
        if not isinstance(data, dict) or not data.get("hf_path"):
            return data
        try:
            derived = model_keys_from_hf(read_hf_config(data["hf_path"]), str(data["hf_path"]))
        except HFModelError:
            return data
        return {**derived, **data}

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"model.moe_router_topk={self.moe_router_topk} must be <= model.num_moe_experts={self.num_moe_experts}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups={self.num_query_groups} must divide "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if isinstance(self.moe_layer_freq, list) and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(
                f"model.moe_layer_freq has {len(self.moe_layer_freq)} entries; expected one per layer "
                f"(model.num_layers={self.num_layers})"
            )
        if isinstance(self.moe_layer_freq, int) and self.moe_layer_freq < 1:
            raise ValueError(f"model.moe_layer_freq={self.moe_layer_freq} must be >= 1 or a 0/1 list")
        if self.num_moe_layers == 0:
            raise ValueError("model has no MoE layer (moe_layer_freq / first_k_dense_layers leave none)")
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ValueError("model.moe_router_num_groups and model.moe_router_group_topk must be set together")
        if groups is not None:
            if self.num_moe_experts % groups:
                raise ValueError(
                    f"model.moe_router_num_groups={groups} must divide num_moe_experts={self.num_moe_experts}"
                )
            if group_topk > groups:
                raise ValueError(f"model.moe_router_group_topk={group_topk} must be <= moe_router_num_groups={groups}")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("model.moe_router_enable_expert_bias requires model.moe_router_score_function='sigmoid'")
        if self.num_moe_experts > 65536:
            raise ValueError(f"model.num_moe_experts={self.num_moe_experts} exceeds the 65536 a uint16 route holds")
        return self


class ParallelConfig(Section):
    """Megatron-Core parallel sizes for the learner."""

    tp: int = Field(1, ge=1, description="tensor_model_parallel_size")
    pp: int = Field(1, ge=1, description="pipeline_model_parallel_size")
    ep: int = Field(1, ge=1, description="expert_model_parallel_size")
    cp: int = Field(1, ge=1, description="context_parallel_size")
    etp: int | None = Field(None, ge=1, description="expert_tensor_parallel_size (None: same as tp)")
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class PrecisionConfig(Section):
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    fp8: FP8Config | None = None
    deterministic: bool = Field(
        False,
        description="CUDA learner: deterministic kernels (torch.use_deterministic_algorithms, warning for ops "
        "without one; CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set; Megatron's deterministic_mode, with "
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 for Transformer Engine's attention), so a resumed run repeats a straight "
        "one bit for bit. The CPU learner is deterministic without it",
    )
