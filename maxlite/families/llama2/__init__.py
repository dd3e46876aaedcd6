"""Llama 2/3/3.1/3.2 and Mistral (`model_type: llama`, `mistral`).

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "llama2", "Llama 2/3/3.1/3.2 and Mistral (sliding_window): pre-RMSNorm, RoPE, GQA, SwiGLU",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="llama3_8b", llama_names=True, hf_model_types=("llama", "mistral"))
