"""Qwen3, dense (`model_type: qwen3`).

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "qwen3", "Qwen3 (dense): Llama's block with per-head RMSNorm on q and k before RoPE",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="qwen3_8b", llama_names=True, hf_model_types=("qwen3",), qk_norm=True)
