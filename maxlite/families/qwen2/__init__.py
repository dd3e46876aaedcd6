"""Qwen2 / Qwen2.5 (`model_type: qwen2`).

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "qwen2", "Qwen2 / Qwen2.5: Llama's block with q/k/v biases (no o bias)",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="qkv", hf_module=__name__ + ".hf",
    nemo_factory="qwen25_7b", llama_names=True, hf_model_types=("qwen2",))
