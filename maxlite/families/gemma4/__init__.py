"""Gemma 4 (text; `model_type: gemma4_text`, and the text model of a multimodal `gemma4` checkpoint):
Gemma4ForCausalLM both ways. The layers: maxlite/models/gemma4.py.

The family's data; its Hugging Face adapter is hf.py beside it.
"""

from __future__ import annotations

import dataclasses

from maxlite.families import Family

FAMILY = Family(
    "gemma4", "Gemma 4 (text): Gemma 3's sandwich with plain-scale norms, v norm, wide proportional-RoPE global "
    "layers, per-layer embeddings, shared keys/values, soft-capped logits",
    norm="rmsnorm", mlp="geglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="gemma3_1b", hf_model_types=("gemma4_text", "gemma4", "gemma4_vision", "gemma4_audio"), llama_names=True, qk_norm=True,
    post_norms=True, embed_scale=True, layer_pattern=("local",) * 5 + ("global",),
    layer_kinds=f"{__name__}:layer_kinds", layer_scalar=True)


def layer_kinds(cfg, kinds: tuple) -> tuple:
    """Gemma 4's mixers: local and (wide) global layers; the last num_kv_shared_layers reuse the keys and
    values of the last earlier layer of their kind (and have the double-wide MLP if asked). `kinds` are
    maxlite.models.layout.LayerKind; replaced, not built, so the family's data imports no model code."""
    first_shared = len(kinds) - cfg.num_kv_shared_layers
    out = []
    for i, k in enumerate(kinds):
        shared = i >= first_shared
        ffn = "dense_wide" if shared and cfg.use_double_wide_mlp and k.ffn == "dense" else k.ffn
        ffn = "gemma4_moe" if ffn == "moe" else ffn  # the dense MLP beside the experts
        out.append(dataclasses.replace(k, mixer=f"gemma4_{k.variant}{'_shared' if shared else ''}", ffn=ffn))
    return tuple(out)
