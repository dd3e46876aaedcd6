"""OLMo 3 (AI2, `model_type: olmo3`): Olmo3ForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

from maxlite.families import Family

FAMILY = Family(
    "olmo3", "OLMo 3: post-norms only, q/k norms over every head, 3 sliding-window layers : 1 global, SwiGLU",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="llama3_8b", hf_model_types=("olmo3",), llama_names=True, qk_norm=True, qk_norm_heads=True,
    pre_norms=False, post_norms=True, layer_pattern=("local",) * 3 + ("global",))
