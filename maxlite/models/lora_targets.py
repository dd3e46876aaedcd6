"""Which LoRA targets (`lora_targets`, Hugging Face / PEFT module names) a model has, by its layers'
mixer kinds: pure data, importable without JAX (config validation uses it; maxlite/models/lora.py
attaches the adapters).

Grouped-query attention has Llama's q/k/v/o_proj; latent attention DeepSeek's q_proj (q_lora_rank
= 0) or q_a_proj and q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; the gated delta-net Qwen3.5's
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a or Qwen3-Next's fused in_proj_qkvz, in_proj_ba, and
out_proj; DeepSeek-V4's attention q_a_proj, q_b_proj, kv_proj and o_b_proj. A fused HF projection is one nn.Linear, so PEFT gives it one A: maxlite keeps one
`{adapter}_lora_a` [in, r] and a `{kernel}_lora_b` [r, out...] per kernel it spans.
"""

from __future__ import annotations

from maxlite.models.layout import layer_kinds

MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# HF module name → (adapter, the kernels its B spans), beside grouped-query attention's and the MLP's
MIXER_ADAPTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "q_a_proj": ("q_a", ("q_a",)), "q_b_proj": ("q_b", ("q_b",)), "kv_a_proj_with_mqa": ("kv_a", ("kv_a",)),
    "kv_b_proj": ("kv_b", ("kv_b",)),
    "in_proj_qkv": ("qkv", ("q", "k", "v")), "in_proj_z": ("z", ("z",)), "in_proj_b": ("b", ("b",)),
    "in_proj_a": ("a", ("a",)), "in_proj_qkvz": ("qkvz", ("q", "k", "v", "z")), "in_proj_ba": ("ba", ("b", "a")),
    "out_proj": ("o", ("o",)),
    "kv_proj": ("kv", ("kv",)), "o_b_proj": ("o_b", ("o_b",)),
}
GQA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# DeepSeek-V4's attention (transformers' module names): its query latent's two projections, the one
# key=value head, the grouped output's second projection (the first, o_a_proj, is block-diagonal, which
# PEFT's LoRA layer cannot adapt; the compressors and the indexer are not adapted)
V4_TARGETS = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
GDN_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "out_proj")


def mla_targets(cfg) -> tuple[str, ...]:
    queries = ("q_a_proj", "q_b_proj") if cfg.q_lora_rank else ("q_proj",)
    return (*queries, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def check(cfg) -> str | None:
    """Why the recipe's lora_targets do not fit its model, or None. Every kind not named here
    (grouped-query attention, Gemma 4's variants of it) has q/k/v/o_proj."""
    kinds = {k.mixer for k in layer_kinds(cfg)}
    valid = set(MLP_TARGETS)
    for kind in kinds:
        valid |= set({"mla": mla_targets(cfg), "dsa": mla_targets(cfg), "gated_deltanet": GDN_TARGETS,
                      "v4_sliding": V4_TARGETS, "v4_hca": V4_TARGETS, "v4_csa": V4_TARGETS}.get(kind, GQA_TARGETS))
    unknown = [t for t in cfg.lora_targets if t not in valid]
    if unknown:
        return (f"lora_targets: {', '.join(unknown)} is not a projection of this model (its layers: "
                f"{', '.join(sorted(kinds))}); choose from {', '.join(sorted(valid))}")
    fused = {"in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}
    for name, parts in fused.items():
        both = [p for p in parts if p in cfg.lora_targets]
        if name in cfg.lora_targets and both:
            return f"lora_targets: {name} is {' + '.join(parts)} fused; name one or the other, not both ({both[0]})"
    return None
