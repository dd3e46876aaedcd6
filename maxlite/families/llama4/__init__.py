"""Llama 4 (Meta, `model_type: llama4_text`): Llama4ForCausalLM both ways (the text model of Scout and
Maverick); their published checkpoints (`model_type: llama4`, Llama4ForConditionalGeneration) import as
that text model.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "llama4", "Llama 4: 3 chunked-attention RoPE layers : 1 global NoPE layer with tempered queries, a scaleless "
    "q/k norm on the RoPE layers, dense and MoE layers interleaved (one sigmoid-routed expert per token, its "
    "weight on the expert's input, one shared expert)",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="llama3_8b", hf_model_types=("llama4_text", "llama4"), moe=True, global_nope=True, qk_l2_norm=True,
    layer_pattern=("chunked",) * 3 + ("global",))
