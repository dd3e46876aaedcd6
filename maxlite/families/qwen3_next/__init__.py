"""Qwen3-Next (`model_type: qwen3_next`, Qwen3NextForCausalLM): Qwen3.5's hybrid layers
(maxlite/families/qwen3_5/) with a mixture of experts, both ways; the MoE tensor and config.json
maps Qwen3.5-MoE shares.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "qwen3_next", "Qwen3-Next: Qwen3.5's hybrid layers (fused delta-net projections) with a mixture of "
    "experts and a gated shared expert", norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention",
    hf_module=__name__ + ".hf", nemo_factory="qwen3_30b_a3b", hf_model_types=("qwen3_next",), norm_offset=1.0,
    qk_norm=True, layer_pattern=("linear",) * 3 + ("global",), attn_output_gate=True, moe=True)
