"""Qwen3-VL-MoE (`model_type: qwen3_vl_moe`, Qwen3VLMoeForConditionalGeneration; Qwen3-VL-30B-A3B and
235B-A22B): Qwen3-VL's decoder (multimodal RoPE, the qwen_vit encoder, DeepStack: maxlite/families/qwen3_vl)
with Qwen3-MoE's mixture of experts in every layer (softmax routing, top k, weights renormalised).

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "qwen3_vl_moe", "Qwen3-VL-MoE: Qwen3-VL's decoder (interleaved multimodal RoPE, the qwen_vit encoder, "
    "DeepStack) with a mixture of SwiGLU experts in every layer",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="qwen3_30b_a3b", llama_names=True, hf_model_types=("qwen3_vl_moe",), qk_norm=True, moe=True)
