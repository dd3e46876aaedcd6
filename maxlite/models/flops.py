"""Training FLOPs per step, counted the way MaxText counts them.

Per layer and per token-batch (B sequences of T tokens; D, N, K, H, F, V, L as in layers.py):
  mlp        = 2·B·T·D·F·m        (m = 3 matrices for SwiGLU/GeGLU, 2 for GELU)
  qkv        = 2·B·T·D·(N + 2K)·H
  out proj   = 2·B·T·N·H·D
  attention  = 4·B·T²·N·H / 2     (QKᵀ and PV; halved because the causal mask skips half; a
                                   sliding-window layer only over its window: 4·B·N·H·(T·W − W²/2))
and once per model: unembedding = 2·B·T·D·V (the input embedding is a lookup, not a matmul); each
multi-token-prediction depth: its [2D, D] projection, one layer of the last layer's kinds, the head;
per-layer embeddings (Gemma 4, P = per_layer_embed_dim): 2·B·T·D·L·P + L·2·(2·B·T·D·P).
A mixture-of-experts layer counts its active parameters, as MaxText does: the router 2·B·T·D·E and
the k routed experts plus the shared ones, each 2·B·T·D·F_moe·m (F_moe = base_moe_mlp_dim); what a
`dense` implementation computes beyond that, and capacity padding, is overhead, not useful work.
Training = 3 × forward (forward + backward's two matmuls per forward matmul); a vision tower adds
its own (frozen: its forward only). Rematerialised
recomputation is not counted (it is overhead, not useful work), as in MaxText's MFU.
"""

from __future__ import annotations

from maxlite.models.families import family
from maxlite.models.kinds import FEED_FORWARDS, MIXERS, attention_core_flops
from maxlite.models.layout import layer_kinds, layer_mlps

attention_flops = attention_core_flops  # one layer's QKᵀ and PV (maxlite.models.kinds)


def forward_flops_by_part(cfg, batch_size: int | None = None) -> dict[str, float]:
    """Forward FLOPs of all layers by part (each mixer kind's parts: qkv, out, attention; mlp) and of
    the unembedding: every layer counts what its kinds say they compute."""
    B = cfg.global_batch_size if batch_size is None else batch_size
    T, D, V = cfg.max_target_length, cfg.base_emb_dim, cfg.vocab_size
    parts = {"qkv": 0.0, "out": 0.0, "mlp": 0.0, "attention": 0.0}
    for kind in layer_kinds(cfg):
        for part, flops in MIXERS[kind.mixer].flops(cfg, B, T, kind.variant).items():
            parts[part] = parts.get(part, 0.0) + flops
        parts["mlp"] += FEED_FORWARDS[kind.ffn].flops(cfg, B * T)
    if cfg.mtp_num_layers:  # each depth: its [2D, D] projection, one layer of the last layer's kinds, the head
        last = layer_kinds(cfg)[-1]
        layer = sum(MIXERS[last.mixer].flops(cfg, B, T, last.variant).values()) + FEED_FORWARDS[last.ffn].flops(cfg, B * T)
        parts["mtp"] = cfg.mtp_num_layers * (2 * B * T * 2 * D * D + layer + 2 * B * T * D * V)
    if cfg.per_layer_embed_dim:  # per-layer embeddings: the projection of the embedding, each layer's gate and proj
        L, P = cfg.base_num_decoder_layers, cfg.per_layer_embed_dim
        parts["per_layer"] = 2 * B * T * D * L * P + L * 2 * (2 * B * T * D * P)
    return {**parts, "unembed": 2 * B * T * D * V}


def mlp_flops(cfg, tokens: int, kind: str) -> float:
    """Forward FLOPs of one layer's feed-forward of that kind ("dense" | "moe")."""
    return FEED_FORWARDS[kind].flops(cfg, tokens)


def train_flops_per_step(cfg, batch_size: int | None = None) -> float:
    """Total (all devices) training FLOPs for one optimizer step: 3 × the decoder's forward, and a
    vision tower's as `vision_train` trains it (maxlite/models/vision/towers.py)."""
    from maxlite.models.vision.towers import train_flops

    B = cfg.global_batch_size if batch_size is None else batch_size
    return 3.0 * sum(forward_flops_by_part(cfg, batch_size).values()) + train_flops(cfg, B)


def param_count(abstract_params) -> int:
    import jax  # local: keep this module importable without JAX for docs tooling

    return sum(int(x.size) for x in jax.tree.leaves(abstract_params))


def active_param_count(cfg, total: int) -> int:
    """Parameters a token uses (of `total`): a MoE layer's unchosen experts left out (the router,
    the k routed and the shared experts counted), as MoE models publish "active" parameters."""
    idle = cfg.num_experts - cfg.num_experts_per_tok
    per_expert = family(cfg).mlp_matrices * cfg.base_emb_dim * cfg.base_moe_mlp_dim
    if cfg.mlp_bias:  # gpt-oss: each expert's gate, up and down biases
        per_expert += 2 * cfg.base_moe_mlp_dim + cfg.base_emb_dim
    return total - sum(FEED_FORWARDS[f].routed for f in layer_mlps(cfg)) * idle * per_expert
