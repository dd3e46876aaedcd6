"""GPT-3 / GPT-2 (`model_type: gpt2`).

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "gpt3", "GPT-3 / GPT-2: pre-LayerNorm, learned positions, biases, GELU",
    norm="layernorm", mlp="gelu", positions="learned", biases="all", hf_module=__name__ + ".hf",
    nemo_factory="gpt3_175b", hf_model_types=("gpt2",))
