"""DeepSeek-V2/V3 (`model_type: deepseek_v2`, `deepseek_v3`; also Kimi K2 and Moonlight, which are
DeepSeek-V3's architecture): DeepseekV2ForCausalLM / DeepseekV3ForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "deepseek", "DeepSeek-V2/V3, Kimi K2, Moonlight: multi-head latent attention (attention_type: mla), dense "
    "first layers then DeepSeekMoE (shared + routed SwiGLU experts)",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="deepseek_v3", hf_model_types=("deepseek_v2", "deepseek_v3", "kimi_k2"), moe=True)
