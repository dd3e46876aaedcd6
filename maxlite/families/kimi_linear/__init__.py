"""Kimi Linear (Moonshot AI, `model_type: kimi_linear`; Kimi-Linear-48B-A3B): KimiLinearForCausalLM
both ways.

The family's data; its Hugging Face adapter is hf.py beside it. Its layers: Kimi delta attention
(the `kda` mixer kind, maxlite/models/kda.py) interleaved with DeepSeek's multi-head latent
attention without positions (NoPE: `positions: none`, the shared key's R dims unrotated), a dense
first layer then DeepSeekMoE (sigmoid routing with a choice bias).
"""

from __future__ import annotations

import dataclasses

from maxlite.families import Family

FAMILY = Family(
    "kimi_linear", "Kimi Linear: Kimi delta attention (a gated delta rule with per-channel decay) : latent "
    "attention without RoPE (attention_type: mla), a dense first layer then DeepSeekMoE",
    norm="rmsnorm", mlp="swiglu", positions="none", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="deepseek_v3", hf_model_types=("kimi_linear",), moe=True,
    layer_pattern=("linear",) * 3 + ("global",), layer_kinds=f"{__name__}:layer_kinds")


def layer_kinds(cfg, kinds: tuple) -> tuple:
    """The linear layers are Kimi delta attention (`linear_attention` names the gated delta-net's
    first). `kinds` are maxlite.models.layout.LayerKind, replaced, not built."""
    return tuple(dataclasses.replace(k, mixer="kda") if k.mixer == "gated_deltanet" else k for k in kinds)
