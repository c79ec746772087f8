"""HF Qwen3-MoE / GLM-4.5 <-> Megatron-Core (local spec) weight conversion and HF checkpoint I/O.

Owns the name/layout mapping between a HuggingFace Qwen3-MoE or GLM-4.5 (``Glm4MoeForCausalLM``:
q/k/v bias, shared experts, score-correction bias; ``model.hf_architecture``) safetensors
checkpoint (on-disk names, one tensor per expert projection) and the learner's
``GPTModel`` state, plus exporting one for SGLang weight sync. Importing reads per rank
(``hf_import.load_hf_weights``, built on ``hf_name_map``); ``read_hf_state_dict`` + ``hf_to_megatron``
convert a whole checkpoint at once (tests and small tools: every tensor in memory, twice). Measured mapping
details: /work/shared/notes/megatron-core-on-cpu.md ("HF Qwen3-MoE <-> ...").

Layout facts that a parity test catches when broken:
  * ``linear_qkv`` rows are grouped per query group: ``[q heads of group g; k_g; v_g]``.
  * ``linear_fc1`` is ``cat([gate_proj, up_proj])`` (gate first, SwiGLU).
Both Megatron specs are handled: TE-spec names are mapped to local-spec names first
(``canonical_name``). tp, etp and ep shards are gathered on export (``moe_rl.learner.tp_shards``).
The per-tensor conversion (``megatron_tensor_to_hf``) is what the streaming export and weight sync use
(``hf_stream``, ``hf_export``); ``export_hf_state_dict`` gathers the whole model (an oracle for tests).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from moe_rl.learner.global_state import gather_global, gather_stages
from moe_rl.learner.hf_init import write_hf_side_files
from moe_rl.learner.model import unwrap
from moe_rl.learner.ownership import (
    canonical_name,
)

__all__ = [
    "canonical_name",
    "export_hf_state_dict",
    "full_megatron_state_dict",
    "hf_name_map",
    "hf_to_megatron",
    "megatron_tensor_to_hf",
    "megatron_to_hf",
    "read_hf_state_dict",
    "write_side_files",
]

# weights are written by the exporter; every other file of the template dir (config, generation config,
# tokenizer files of any kind, chat template, custom code) is copied, so the export is a loadable HF model
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _side_files(template_dir: Path) -> list[Path]:
    return sorted(
        p
        for p in template_dir.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and not p.name.endswith(_WEIGHT_SUFFIXES)
        and p.name not in _WEIGHT_INDEXES
    )


def _qkv_split_sizes(m) -> tuple[int, int, int]:
    heads_per_group = m.num_attention_heads // m.num_query_groups
    return heads_per_group * m.kv_channels, m.kv_channels, m.kv_channels


def _pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m) -> torch.Tensor:
    """HF ``q[nh*d(, H)], k[ng*d(, H)], v[ng*d(, H)]`` -> Megatron ``qkv[ng*(nh/ng+2)*d(, H)]`` (weights or biases)."""
    g = m.num_query_groups
    tail = q.shape[1:]
    qs, ks, vs = _qkv_split_sizes(m)
    per_group = torch.cat([q.reshape(g, qs, *tail), k.reshape(g, ks, *tail), v.reshape(g, vs, *tail)], dim=1)
    return per_group.reshape(-1, *tail)


def _unpack_qkv(qkv: torch.Tensor, m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = m.num_query_groups
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(g, -1, *tail).split(_qkv_split_sizes(m), dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def _mlp_names(hf: str, mg: str):
    yield "fc1", (hf + "gate_proj.weight", hf + "up_proj.weight"), mg + "linear_fc1.weight"
    yield "copy", (hf + "down_proj.weight",), mg + "linear_fc2.weight"


def _layer_names(i: int, is_moe: bool, m):
    """Yield ``(kind, hf_names, megatron_name)`` for decoder layer ``i`` (global expert ids)."""
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    yield "copy", (hf + "input_layernorm.weight",), mg + "input_layernorm.weight"
    yield "qkv", tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"), mg + "self_attention.linear_qkv.weight"
    if m.add_qkv_bias:
        yield "qkv", tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"), mg + "self_attention.linear_qkv.bias"
    yield "copy", (hf + "self_attn.o_proj.weight",), mg + "self_attention.linear_proj.weight"
    if m.qk_layernorm:
        yield "copy", (hf + "self_attn.q_norm.weight",), mg + "self_attention.q_layernorm.weight"
        yield "copy", (hf + "self_attn.k_norm.weight",), mg + "self_attention.k_layernorm.weight"
    yield "copy", (hf + "post_attention_layernorm.weight",), mg + "pre_mlp_layernorm.weight"
    if not is_moe:
        yield from _mlp_names(hf + "mlp.", mg + "mlp.")
        return
    yield "copy", (hf + "mlp.gate.weight",), mg + "mlp.router.weight"
    for e in range(m.num_moe_experts):
        yield from _mlp_names(hf + f"mlp.experts.{e}.", mg + f"mlp.experts.local_experts.{e}.")
    if m.moe_shared_expert_intermediate_size:
        yield from _mlp_names(hf + "mlp.shared_experts.", mg + "mlp.shared_experts.")


def _all_names(m):
    yield "copy", ("model.embed_tokens.weight",), "embedding.word_embeddings.weight"
    for i, is_moe in enumerate(m.moe_layer_pattern()):
        yield from _layer_names(i, bool(is_moe), m)
    yield "copy", ("model.norm.weight",), "decoder.final_layernorm.weight"
    yield "copy", ("lm_head.weight",), "output_layer.weight"


def _expert_bias_names(m):
    """Sigmoid routers with expert bias: DeepSeek-V3's ``e_score_correction_bias``."""
    if not m.moe_router_enable_expert_bias:
        return
    for i, is_moe in enumerate(m.moe_layer_pattern()):
        if is_moe:
            yield f"model.layers.{i}.mlp.gate.e_score_correction_bias", f"decoder.layers.{i}.mlp.router.expert_bias"


def hf_to_megatron(hf: Mapping[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """HF on-disk ``{name: tensor}`` -> full Megatron state (all experts, global ids, tp=1)."""
    missing = [n for _, names, _ in _all_names(model_cfg) for n in names if n not in hf]
    if missing:
        raise KeyError(f"HF checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[:3]}")
    out: dict[str, torch.Tensor] = {}
    for kind, names, mg_name in _all_names(model_cfg):
        ts = [hf[n] for n in names]
        if kind == "qkv":
            out[mg_name] = _pack_qkv(*ts, model_cfg)
        elif kind == "fc1":
            out[mg_name] = torch.cat(ts, dim=0)  # gate first: Megatron's SwiGLU chunks [gate, up]
        else:
            out[mg_name] = ts[0]
    for hf_name, mg_name in _expert_bias_names(model_cfg):
        if hf_name not in hf:
            raise KeyError(f"HF checkpoint lacks {hf_name!r} (model.moe_router_enable_expert_bias=true)")
        out[mg_name] = hf[hf_name]
    return out


def hf_name_map(model_cfg) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``{Megatron global name: (kind, HF names)}`` of the whole model (kind: ``copy``, ``qkv`` or ``fc1``)."""
    out = {mg: (kind, names) for kind, names, mg in _all_names(model_cfg)}
    out.update({mg: ("copy", (hf,)) for hf, mg in _expert_bias_names(model_cfg)})
    return out


def megatron_tensor_to_hf(
    mg_name: str, t: torch.Tensor, model_cfg, names: dict | None = None
) -> list[tuple[str, torch.Tensor]]:
    """One full Megatron tensor (global name, tp=1) -> its HF ``(name, tensor)`` pieces (``names``: ``hf_name_map``).

    A ``copy`` tensor is returned as it is (a view of the caller's tensor when that is one)."""
    kind, hf = (names if names is not None else hf_name_map(model_cfg)).get(mg_name, (None, ()))
    if kind is None:
        raise KeyError(f"{mg_name!r} has no Hugging Face name for this model config (model.* differs from the model)")
    if kind == "qkv":
        parts = _unpack_qkv(t, model_cfg)
    elif kind == "fc1":
        parts = t.chunk(2, dim=0)  # gate first: Megatron's SwiGLU chunks [gate, up]
    else:
        parts = (t,)
    return [(n, p if p.is_contiguous() else p.contiguous()) for n, p in zip(hf, parts, strict=True)]


def megatron_to_hf(mg: Mapping[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """Full Megatron state (global expert ids, tp=1) -> HF on-disk ``{name: tensor}``."""
    names = hf_name_map(model_cfg)
    out: dict[str, torch.Tensor] = {}
    for kind, _, mg_name in _all_names(model_cfg):
        if mg_name not in mg:
            raise KeyError(f"Megatron state lacks {mg_name!r} (expected a full, tp- and ep-gathered state)")
        out.update(megatron_tensor_to_hf(mg_name, mg[mg_name], model_cfg, names))
    for _, mg_name in _expert_bias_names(model_cfg):
        if mg_name in mg:
            out.update(megatron_tensor_to_hf(mg_name, mg[mg_name], model_cfg, names))
    return out


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint dir (single file or sharded with index)."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(hf_dir / f))
    return state


def full_megatron_state_dict(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """This model's parameters (and expert-bias buffers), tp/etp shards and ep experts gathered.

    Collective over the tensor-, expert-tensor- and expert-parallel groups: every rank must call
    it. Returns full CPU tensors named with global expert ids and global layer numbers (this
    pipeline stage's layers; ``global_state.gather_global``). ``grads=True`` gathers each
    parameter's ``main_grad`` (Megatron DDP) or ``grad`` instead.
    """
    m = unwrap(model)
    if grads:
        local = {n: (p.main_grad if hasattr(p, "main_grad") else p.grad).detach() for n, p in m.named_parameters()}
    else:
        local = {n: p.detach() for n, p in m.named_parameters()}
        local.update({n: b.detach() for n, b in m.named_buffers() if n.endswith("router.expert_bias")})
    return gather_global(model, local)


def write_side_files(out: Path, model_cfg, template_dir: Path | None) -> None:
    """config.json, tokenizer and the rest of an HF dir but its weights: copied from ``template_dir``, else made."""
    if template_dir is not None:
        for f in _side_files(template_dir):
            shutil.copy2(f, out / f.name)
        return

    write_hf_side_files(model_cfg, out)


def export_hf_state_dict(model, model_cfg, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """The whole model as HF ``{name: tensor}`` in rank 0's memory (CPU): an oracle for tests and small models.

    Collective over the tp / ep / pp groups; returns the dict on rank 0, None elsewhere. The trainer never
    calls it: its syncs and exports stream bucket by bucket from the owning ranks (``hf_stream``, ``hf_export``).
    """

    state = gather_stages(full_megatron_state_dict(model))
    if state is None or (dist.is_initialized() and dist.get_rank() != 0):
        return None
    hf = megatron_to_hf(state, model_cfg)
    return hf if dtype is None else {k: v.to(dtype) for k, v in hf.items()}
