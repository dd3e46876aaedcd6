"""GLM-4.5 / GLM-4.6 (Zhipu AI, `model_type: glm4_moe`): Glm4MoeForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "glm4_moe", "GLM-4.5/4.6: GQA with q/k/v biases, half-rotary RoPE, optional q/k norms, dense first layers "
    "then DeepSeekMoE (sigmoid routing, choice bias, a shared expert)",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="qkv", hf_module=__name__ + ".hf",
    nemo_factory="qwen3_30b_a3b", hf_model_types=("glm4_moe",), llama_names=True, moe=True)
