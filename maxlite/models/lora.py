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

from maxlite.models.lora_targets import MIXER_ADAPTERS


class LoRAParam(nnx.Param):
    """A trainable adapter weight; everything else is frozen when the model has any."""


# HF module name → (maxlite block, kernel, number of input dims of that kernel)
TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("attn", "q", 1), "k_proj": ("attn", "k", 1), "v_proj": ("attn", "v", 1),
    "o_proj": ("attn", "o", 2),
    "gate_proj": ("mlp", "gate", 1), "up_proj": ("mlp", "up", 1), "down_proj": ("mlp", "down", 1),
}
HF_BLOCK = {"attn": "self_attn", "mlp": "mlp"}

# HF module name → (adapter, the kernels its B spans), for every mixer (maxlite/models/lora_targets.py)
ADAPTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    **{t: (kernel, (kernel,)) for t, (_, kernel, _) in TARGETS.items()}, **MIXER_ADAPTERS}
KERNELS = dict(ADAPTERS.values())  # adapter → the kernels its B spans


def enabled(cfg, kernel: str) -> bool:
    return cfg.lora_rank > 0 and any(TARGETS[t][1] == kernel for t in cfg.lora_targets if t in TARGETS)


def make(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, n_in: int, rank: int, dtype) -> tuple:
    """(A, B) for a kernel of `shape` with logical `axes`, its first `n_in` dims the input."""
    fan_in = int(np.prod(shape[:n_in]))
    a = jax.random.normal(rngs.params(), (*shape[:n_in], rank), dtype) / np.sqrt(fan_in)
    b = jnp.zeros((rank, *shape[n_in:]), dtype)
    return (LoRAParam(a, out_sharding=(*axes[:n_in], None)),
            LoRAParam(b, out_sharding=(None, *axes[n_in:])))


def delta(x: jax.Array, a: nnx.Variable, b: nnx.Variable, n_in: int, scale: float, dtype) -> jax.Array:
    """(alpha / r) · (x @ A) @ B, contracting x's last `n_in` dims with A's first."""
    return _up(_down(x, a, n_in, dtype), b, scale, dtype)


def _down(x, a, n_in: int, dtype):
    return jax.lax.dot_general(x, a[...].astype(dtype), (((tuple(range(x.ndim - n_in, x.ndim))), tuple(range(n_in))),
                                                         ((), ())))


def _up(h, b, scale: float, dtype):
    return scale * jax.lax.dot_general(h, b[...].astype(dtype), (((h.ndim - 1,), (0,)), ((), ())))


KERNEL_INDEX = {kernel: i for i, (_, kernel, _) in enumerate(TARGETS.values())}  # each its own mask
KERNEL_INDEX |= {a: len(KERNEL_INDEX) + i for i, a in enumerate(  # the mixers' adapters after them
    dict.fromkeys(a for a in KERNELS if a not in KERNEL_INDEX))}


def attach(module, cfg, rngs: nnx.Rngs, owned: dict[str, tuple[int, dict[str, tuple[tuple, tuple]]]]) -> None:
    """A mixer's adapters: for each HF name it has (→ (n_in, {kernel: (shape, logical axes)}), the
    kernels that HF projection spans) that the recipe targets, one A and a B per kernel."""
    module.lora_scale = scale(cfg) if cfg.lora_rank else 0.0
    module.lora_dropout = cfg.lora_dropout
    wd = jnp.dtype(cfg.weight_dtype)
    for target, (n_in, kernels) in owned.items():
        if not cfg.lora_rank or target not in cfg.lora_targets:
            continue
        adapter = ADAPTERS[target][0]
        for i, (kernel, (shape, axes)) in enumerate(kernels.items()):
            a, b = make(rngs, shape, axes, n_in, cfg.lora_rank, wd)
            if i == 0:  # the fused projection's one A, from its input side
                setattr(module, f"{adapter}_lora_a", a)
            setattr(module, f"{kernel}_lora_b", b)


def adapt(module, adapter: str, x: jax.Array, *ys: jax.Array, n_in: int = 1, dropout_key=None):
    """ys (x @ each kernel the adapter spans) plus their LoRA updates (α/r)·(x A) B_k, if the module
    has the adapter; with `dropout_key` (training with lora_dropout > 0) x goes through dropout."""
    a = getattr(module, f"{adapter}_lora_a", None)
    if a is not None:
        if dropout_key is not None and module.lora_dropout > 0:
            x = dropout(jax.random.fold_in(dropout_key, KERNEL_INDEX[adapter]), x, module.lora_dropout)
        h = _down(x, a, n_in, ys[0].dtype)
        ys = tuple(y + _up(h, getattr(module, f"{k}_lora_b"), module.lora_scale, y.dtype)
                   for y, k in zip(ys, KERNELS[adapter]))
    return ys if len(ys) > 1 else ys[0]


def weight(module, kernel: str, n_in: int = 1) -> jax.Array:
    """The kernel with its (single-kernel) adapter folded in, W + (α/r)·A B: for a path that uses the
    weight itself (latent attention's absorbed decode)."""
    w = getattr(module, kernel)[...]
    a = getattr(module, f"{kernel}_lora_a", None)
    if a is None:
        return w
    return w + _up(a[...].astype(w.dtype), getattr(module, f"{kernel}_lora_b"), module.lora_scale, w.dtype)


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
        for adapter in sorted(k[:-len("_lora_a")] for k in list(node) if str(k).endswith("_lora_a")):
            a = np.asarray(node.pop(f"{adapter}_lora_a"), np.float32)
            for kernel in KERNELS.get(adapter, (adapter,)):  # a fused projection's A serves each kernel
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
