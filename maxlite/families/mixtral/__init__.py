"""Mixtral (`model_type: mixtral`): a mixture of experts on Mistral's block.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "mixtral", "Mixtral: Mistral's block (sliding_window optional) with a mixture of SwiGLU experts",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="mixtral_8x7b", hf_model_types=("mixtral",), moe=True)
