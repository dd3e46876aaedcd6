"""Training FLOPs per step, counted the way MaxText counts them.

Per layer and per token-batch (B sequences of T tokens; D, N, K, H, F, V, L as in layers.py):
  mlp        = 2·B·T·D·F·m        (m = 3 matrices for SwiGLU, 2 for GELU)
  qkv        = 2·B·T·D·(N + 2K)·H
  out proj   = 2·B·T·N·H·D
  attention  = 4·B·T²·N·H / 2     (QKᵀ and PV; halved because the causal mask skips half)
and once per model: unembedding = 2·B·T·D·V (the input embedding is a lookup, not a matmul).
Training = 3 × forward (forward + backward's two matmuls per forward matmul). Rematerialised
recomputation is not counted (it is overhead, not useful work), as in MaxText's MFU.
"""

from __future__ import annotations

from maxlite.models.families import family


def train_flops_per_step(cfg, batch_size: int | None = None) -> float:
    """Total (all devices) training FLOPs for one optimizer step."""
    B = cfg.global_batch_size if batch_size is None else batch_size
    T, D, F, V, L = (cfg.max_target_length, cfg.base_emb_dim, cfg.base_mlp_dim, cfg.vocab_size,
                     cfg.base_num_decoder_layers)
    N, K, H = cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    mlp_matrices = family(cfg).mlp_matrices
    tokens = B * T
    mlp = 2 * tokens * D * F * mlp_matrices
    qkv = 2 * tokens * D * (N + 2 * K) * H
    out_proj = 2 * tokens * N * H * D
    attention = 4 * B * T * T * N * H / 2
    unembed = 2 * tokens * D * V
    return 3.0 * (L * (mlp + qkv + out_proj + attention) + unembed)


def param_count(abstract_params) -> int:
    import jax  # local: keep this module importable without JAX for docs tooling

    return sum(int(x.size) for x in jax.tree.leaves(abstract_params))
