"""DeepSeek-V3.2 (`model_type: deepseek_v32`): DeepseekV32ForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it. DeepSeek-V3's layers (dense first
layers then DeepSeekMoE, sigmoid routing with a choice bias, in groups) with DeepSeek sparse
attention in every layer: latent attention over the tokens a lightning indexer keeps (the `dsa`
mixer kind, maxlite/models/dsa.py).
"""

from __future__ import annotations

import dataclasses

from maxlite.families import Family

FAMILY = Family(
    "deepseek_v32", "DeepSeek-V3.2: DeepSeek sparse attention (latent attention over the index_topk tokens its "
    "lightning indexer keeps; attention_type: mla), dense first layers then DeepSeekMoE",
    norm="rmsnorm", mlp="swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="deepseek_v3", hf_model_types=("deepseek_v32",), moe=True,
    layer_pattern=("global",), layer_kinds=f"{__name__}:layer_kinds")


def layer_kinds(cfg, kinds: tuple) -> tuple:
    """Every latent attention layer is DeepSeek sparse attention. `kinds` are maxlite.models.layout.LayerKind,
    replaced, not built."""
    return tuple(dataclasses.replace(k, mixer="dsa") if k.mixer == "mla" else k for k in kinds)
