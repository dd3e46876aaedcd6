"""MiniMax-M2 (MiniMax, `model_type: minimax_m2`): MiniMaxM2ForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "minimax_m2", "MiniMax-M2: GQA with q/k norms over every head at once, partial RoPE, experts in every layer "
    "routed by sigmoid with a choice bias (no shared expert)",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="qwen3_30b_a3b", hf_model_types=("minimax_m2",), qk_norm=True, qk_norm_heads=True, moe=True)
