"""Mistral 4 (Mistral AI, `model_type: mistral4`; Mistral Small 4): Mistral4ForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it. Its layers are DeepSeek-V3's kinds:
multi-head latent attention (attention_type: mla) and DeepSeekMoE, routed by softmax without a bias.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "mistral4", "Mistral 4 (Mistral Small 4): multi-head latent attention (attention_type: mla), optional dense "
    "first layers then DeepSeekMoE (shared + routed SwiGLU experts, softmax routing, renormalised top-k)",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="deepseek_v3", hf_model_types=("mistral4",), moe=True)
