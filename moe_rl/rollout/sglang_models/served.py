"""SGLang's own Qwen3-MoE and GLM-4.5-MoE classes (the Qwen3-MoE and GLM / DeepSeek-V3-style configs)."""

from sglang.srt.models import glm4_moe, qwen3_moe

EntryClass = [qwen3_moe.EntryClass, *glm4_moe.EntryClass]
