"""DeepSeek-V4 (`model_type: deepseek_v4`): DeepseekV4ForCausalLM both ways.

The family's data; its Hugging Face adapter is hf.py beside it. Every layer: one shared key=value
head attending a sliding window, alone (`sliding_attention`) or with compressed entries of the whole
context — heavily compressed (`heavily_compressed_attention`: one entry per compress_rate_hca tokens,
every earlier one attended) or compressed and sparse (`compressed_sparse_attention`: one per
compress_rate_csa tokens in overlapping windows, a lightning indexer keeping each query's
index_topk) — with attention sinks and a grouped output projection (the `v4_*` mixer kinds,
maxlite/models/v4_attention.py); DeepSeekMoE in every layer with √softplus scores, clamped SwiGLU
experts, the first num_hash_layers routed by a table of token ids (`hash_moe`); the residual as
hc_mult streams joined by hyper-connections (maxlite/models/hyper.py).
"""

from __future__ import annotations

import dataclasses

from maxlite.families import Family

FAMILY = Family(
    "deepseek_v4", "DeepSeek-V4: compressed (HCA) and compressed sparse (CSA) attention beside a sliding "
    "window, one shared key=value head, sinks, grouped output projection; hyper-connections; DeepSeekMoE "
    "with √softplus scores, clamped SwiGLU and hash-routed first layers",
    norm="rmsnorm", mlp="limited_swiglu", positions="rope", biases="attention", hf_module=__name__ + ".hf",
    nemo_factory="deepseek_v3", hf_model_types=("deepseek_v4",), moe=True,
    layer_pattern=("hca",), layer_kinds=f"{__name__}:layer_kinds")

# transformers' default schedule (DeepseekV4Config): two heavily compressed layers, then compressed
# sparse and heavily compressed in turn
_MIXERS = {"sliding_attention": ("v4_sliding", "v4_local"), "heavily_compressed_attention": ("v4_hca", "hca"),
           "compressed_sparse_attention": ("v4_csa", "csa")}


def default_layer_types(layers: int) -> list[str]:
    """transformers' DeepseekV4Config layer_types when config.json states none."""
    rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(layers - 2, 0))]
    return (["heavily_compressed_attention"] * min(layers, 2) + rest)[:layers]


def layer_kinds(cfg, kinds: tuple) -> tuple:
    """The recipe's layer_types (a sliding-window layer is `v4_sliding`), else transformers' default
    schedule; the first num_hash_layers MoE layers hash-routed. `kinds` are
    maxlite.models.layout.LayerKind, replaced, not built."""
    types = list(cfg.layer_types) or default_layer_types(cfg.base_num_decoder_layers)
    out = []
    for i, (k, hf) in enumerate(zip(kinds, types)):
        mixer, variant = _MIXERS[hf]
        ffn = "hash_moe" if k.ffn == "moe" and i < cfg.num_hash_layers else k.ffn
        out.append(dataclasses.replace(k, mixer=mixer, variant=variant, ffn=ffn))
    return tuple(out)
