"""GLM-5 (Zhipu AI, `model_type: glm_moe_dsa`): GlmMoeDsaForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it. DeepSeek-V3.2's kinds: DeepSeek sparse
attention in every layer (the `dsa` mixer kind over latent attention, maxlite/models/dsa.py), dense
first layers then DeepSeekMoE with sigmoid routing and a choice bias. What differs from DeepSeek-V3.2 is
the indexer's RoPE (interleaved pairs, not split halves), which the adapter's permutation absorbs, so the
layers compute exactly DeepSeek-V3.2's. Its cross-layer top-k sharing (`indexer_types` with "shared"
layers) is refused at import: every layer of GLM-5 runs its own indexer.
"""

from __future__ import annotations

from maxlite.families import Family
from maxlite.families.deepseek_v32 import layer_kinds  # noqa: F401  (the family's layer_kinds, named below)

FAMILY = Family(
    "glm_moe_dsa", "GLM-5: DeepSeek sparse attention (latent attention over the index_topk tokens its lightning "
    "indexer keeps; attention_type: mla), dense first layers then DeepSeekMoE (DeepSeek-V3.2's layers)",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="deepseek_v3", hf_model_types=("glm_moe_dsa",), moe=True,
    layer_pattern=("global",), layer_kinds=f"{__name__}:layer_kinds")
