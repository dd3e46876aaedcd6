"""Qwen3-MoE (`model_type: qwen3_moe`): a mixture of experts on Qwen3's block.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "qwen3_moe", "Qwen3-MoE: Qwen3's block (q/k norms) with a mixture of SwiGLU experts",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="qwen3_30b_a3b", hf_model_types=("qwen3_moe",), qk_norm=True, moe=True)
