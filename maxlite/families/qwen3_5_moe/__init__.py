"""Qwen3.5-MoE (`model_type: qwen3_5_moe_text`, Qwen3_5MoeForCausalLM): Qwen3.5's hybrid layers
(maxlite/families/qwen3_5/: separate delta-net projections) with a mixture of experts in every
layer and Qwen3-Next's gated shared expert (maxlite/families/qwen3_next/: the MoE tensors).

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "qwen3_5_moe", "Qwen3.5-MoE: Qwen3.5's hybrid layers with experts in every layer and a gated shared expert",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="qwen3_30b_a3b", hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"), norm_offset=1.0, qk_norm=True,
    layer_pattern=("linear",) * 3 + ("global",), attn_output_gate=True, moe=True)
