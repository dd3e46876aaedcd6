"""Qwen3.5 (dense; `model_type: qwen3_5_text`, Qwen3_5ForCausalLM): three gated delta-net layers to
one full-attention layer, both ways; the tensor and config.json maps the Qwen3.5-MoE and Qwen3-Next
modules share.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "qwen3_5", "Qwen3.5 (dense): 3 gated delta-net layers : 1 gated full attention (partial RoPE, q/k norms), "
    "(1 + w) RMSNorm, SwiGLU", norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention",
    hf_module=__name__ + ".hf", nemo_factory="qwen3_8b", hf_model_types=("qwen3_5_text", "qwen3_5"), norm_offset=1.0,
    qk_norm=True, layer_pattern=("linear",) * 3 + ("global",), attn_output_gate=True)
