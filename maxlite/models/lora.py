"""LoRA: low-rank adapters on the attention and MLP projections (`lora_rank` > 0).

A projection x @ W (W [in..., out...]) becomes x @ W + (alpha / r) · (x @ A) @ B with A [in..., r]
and B [r, out...]. A starts random, B at zero, so step 0 computes the base model. With
`lora_dropout` > 0 the training step feeds the adapters x through dropout (PEFT's placement), its
mask a function of (seed, step, micro-batch, layer, kernel): a resumed run draws the same masks. The adapters are
`LoRAParam`s (a `nnx.Param` subclass): the train step differentiates and the optimizer holds only
them (state.trainable); the base weights are frozen and not in the optimizer state. A and B take
their base weight's logical axes on the in and out sides (FSDP / tensor sharding follow W); the
rank axis is not split. Targets use Hugging Face's names (PEFT's `target_modules`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class LoRAParam(nnx.Param):
    """A trainable adapter weight; everything else is frozen when the model has any."""


# HF module name → (maxlite block, kernel, number of input dims of that kernel)
TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("attn", "q", 1), "k_proj": ("attn", "k", 1), "v_proj": ("attn", "v", 1),
    "o_proj": ("attn", "o", 2),
    "gate_proj": ("mlp", "gate", 1), "up_proj": ("mlp", "up", 1), "down_proj": ("mlp", "down", 1),
}
HF_BLOCK = {"attn": "self_attn", "mlp": "mlp"}


def enabled(cfg, kernel: str) -> bool:
    return cfg.lora_rank > 0 and any(TARGETS[t][1] == kernel for t in cfg.lora_targets)


def make(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, n_in: int, rank: int, dtype) -> tuple:
    """(A, B) for a kernel of `shape` with logical `axes`, its first `n_in` dims the input."""
    fan_in = int(np.prod(shape[:n_in]))
    a = jax.random.normal(rngs.params(), (*shape[:n_in], rank), dtype) / np.sqrt(fan_in)
    b = jnp.zeros((rank, *shape[n_in:]), dtype)
    return (LoRAParam(a, out_sharding=(*axes[:n_in], None)),
            LoRAParam(b, out_sharding=(None, *axes[n_in:])))


def delta(x: jax.Array, a: nnx.Variable, b: nnx.Variable, n_in: int, scale: float, dtype) -> jax.Array:
    """(alpha / r) · (x @ A) @ B, contracting x's last `n_in` dims with A's first."""
    a_, b_ = a[...].astype(dtype), b[...].astype(dtype)
    h = jax.lax.dot_general(x, a_, (((tuple(range(x.ndim - n_in, x.ndim))), tuple(range(n_in))), ((), ())))
    return scale * jax.lax.dot_general(h, b_, (((h.ndim - 1,), (0,)), ((), ())))


KERNEL_INDEX = {kernel: i for i, (_, kernel, _) in enumerate(TARGETS.values())}  # each its own mask


def dropout(key: jax.Array, x: jax.Array, rate: float) -> jax.Array:
    """Inverted dropout of the adapters' input (training only; eval and decoding pass no key)."""
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def scale(cfg) -> float:
    return cfg.lora_alpha / cfg.lora_rank


def names(cfg) -> list[tuple[str, str, str, int]]:
    """(hf target, block, kernel, n_in) of the recipe's targets that this family has."""
    return [(t, *TARGETS[t]) for t in cfg.lora_targets]


def merged(cfg, pure: dict[str, Any]) -> dict[str, Any]:
    """A nested numpy params tree with each adapter folded into its kernel (float32 math) and the
    adapters dropped: what the HF export writes, and what the model computes. Wherever a block
    holds adapters: a stacked one ([L, ...] or [units, ...] leaves) or one layer's."""
    if cfg.lora_rank == 0:
        return pure
    s = scale(cfg)
    out = _copy(pure)

    def fold(node: dict) -> None:
        for child in node.values():
            if isinstance(child, dict):
                fold(child)
        for kernel in sorted(k[:-len("_lora_a")] for k in list(node) if str(k).endswith("_lora_a")):
            a = np.asarray(node.pop(f"{kernel}_lora_a"), np.float32)
            b = np.asarray(node.pop(f"{kernel}_lora_b"), np.float32)
            w = np.asarray(node[kernel])
            stacked = a.ndim + b.ndim - 2 > w.ndim  # both carry the stack's leading axis
            update = _stacked_product(a, b) if stacked else _stacked_product(a[None], b[None])[0]
            node[kernel] = (w.astype(np.float32) + s * update).astype(w.dtype)
    fold(out)  # every stack (dense_layers, layers, a hybrid's units) and unrolled layer
    return out


def _stacked_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A [L, in..., r] @ B [L, r, out...] per layer."""
    L, r = a.shape[0], a.shape[-1]
    in_shape, out_shape = a.shape[1:-1], b.shape[2:]
    prod = np.matmul(a.reshape(L, -1, r), b.reshape(L, r, -1))
    return prod.reshape(L, *in_shape, *out_shape)


def _copy(tree):
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree
