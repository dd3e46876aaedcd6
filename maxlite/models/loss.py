"""Cross-entropy (+ z-loss) of the output head without ever holding the [B, T, V] logits, nor the
head's whole float32 gradient on one device.

Forward: the sequence is cut into n = `num_vocab_tiling` chunks (MaxText's key); a scan computes
each chunk's logits [B, C, V], its log-partition and target logit, and keeps only sums and the
log-partitions. A chunk takes every n-th token (chunk k: tokens k, k + n, k + 2n, …): the sums do
not care about order, and a sequence split over context shards stays split the same way inside
every chunk (each device computes its own tokens' logits, none gathers another's hidden states).

Backward (a custom VJP): the VOCABULARY is cut into m tiles (m the largest divisor of V not above
n), tile j holding words j, j + m, j + 2m, … (so a vocabulary split over `tensor` stays split the
same way inside every tile). A scan over the tiles recomputes each tile's logits [B, T, V/m] from
the saved log-partitions, adds its share to the input gradient (a float32 carry [B, T, D]) and
returns the tile's share of the head's gradient, [D, V/m], constrained to the head's own sharding
(`embed` × `vocab`, mesh.RULES). The head's gradient is a sum over every token of the batch: a
device's partial sum covers the whole head, and a sequence-chunked backward held that partial,
[D, V] float32, whole on every device (7.8 GiB per chip for Llama 3.1-405B) before reducing it.
Tiled, a device holds one tile's partial [D, V/m] at a time, reduced at once into the head's
layout; the price is the input gradient's float32 carry [B, T, D] per device. Peak memory holds
one tile's logits [B, T, V/m] (as many values as a forward chunk's), never T·V per sequence.

The head comes as stored (`Transformer.head()`: the embedding table [V, D], spec "vd", when tied,
else [D, V], "dv") and its gradient leaves in that layout and dtype, accumulated in float32: never
a transposed bf16 dot result (XLA's CPU dot cannot produce one) nor a bf16-rounded sum.
Shape legend as in layers.py; C chunk length, n number of chunks, m number of vocabulary tiles,
U = V/m words per tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxlite.models.layers import BTD, constrain
from maxlite.models.matmul import project

AUTO_CHUNK = 512               # tokens per chunk when num_vocab_tiling = -1 ...
AUTO_MIN_LOGITS = 2**27        # ... and a sequence's logits T·V reach this many values


def num_chunks(cfg, seq_len: int, shards: int = 1) -> int:
    """Chunks for this sequence length: the key, or (auto) chunks of 512 tokens per device when a
    device's logits (T/shards)·V reach AUTO_MIN_LOGITS; `shards`: the context shards of a sequence."""
    if cfg.num_vocab_tiling > 0:
        return cfg.num_vocab_tiling
    per_device = seq_len // shards
    if per_device * cfg.vocab_size < AUTO_MIN_LOGITS or per_device <= AUTO_CHUNK:
        return 1
    n = per_device // AUTO_CHUNK
    while seq_len % n:
        n -= 1
    return n


def _chunks(x_BT, n: int):
    """[B, T, ...] → [n, B, T/n, ...], chunk k holding tokens k, k + n, …: the batch dim and a
    split of the sequence stay where they were."""
    B, T = x_BT.shape[:2]
    return jnp.moveaxis(x_BT.reshape(B, T // n, n, *x_BT.shape[2:]), 2, 0)


def _unchunk(x_nBC):
    n, B, C = x_nBC.shape[:3]
    return jnp.moveaxis(x_nBC, 0, 2).reshape(B, C * n, *x_nBC.shape[3:])


def _logits(x_BCD, head, spec: str, softcap: float = 0.0):
    """The chunk's logits, soft-capped to c·tanh(z/c) when `softcap` c > 0 (Gemma 4)."""
    logits_BCV = project(f"bcd,{spec}->bcv", x_BCD, head).astype(jnp.float32)
    if softcap:
        logits_BCV = softcap * jnp.tanh(logits_BCV / softcap)
    return constrain(logits_BCV, ("activation_batch", "activation_length", "activation_vocab"))


def _forward(x_BTD, head, targets_BT, weights_BT, z_loss_weight, n, spec, softcap):
    def body(carry, xs):
        loss_sum, xent_sum = carry
        x_BCD, targets_BC, weights_BC = xs
        logits_BCV = _logits(x_BCD, head, spec, softcap)
        log_z_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
        target_BC = jnp.take_along_axis(logits_BCV, targets_BC[..., None], axis=-1)[..., 0]
        xent = jnp.sum((log_z_BC - target_BC) * weights_BC)
        z = jnp.sum(jnp.square(log_z_BC) * weights_BC)
        return (loss_sum + xent + z_loss_weight * z, xent_sum + xent), log_z_BC

    zero = jnp.zeros((), jnp.float32)
    xs = (_chunks(x_BTD, n), _chunks(targets_BT, n), _chunks(weights_BT, n))
    (loss_sum, xent_sum), log_z_nBC = jax.lax.scan(body, (zero, zero), xs)
    return (loss_sum, xent_sum), log_z_nBC


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def chunked_loss_sums(x_BTD, head, targets_BT, weights_BT, z_loss_weight: float, n: int,
                      spec: str = "dv", softcap: float = 0.0):
    """(Σ w·(xent + z_loss_weight·log_z²), Σ w·xent) over all tokens, in n sequence chunks; `head`
    is [D, V] (spec "dv") or [V, D] ("vd"), in any dtype (cast to x's for the products); logits
    soft-capped when `softcap` > 0."""
    return _forward(x_BTD, head, targets_BT, weights_BT, z_loss_weight, n, spec, softcap)[0]


def _fwd(x_BTD, head, targets_BT, weights_BT, z_loss_weight, n, spec, softcap):
    sums, log_z_nBC = _forward(x_BTD, head, targets_BT, weights_BT, z_loss_weight, n, spec, softcap)
    return sums, (x_BTD, head, targets_BT, weights_BT, log_z_nBC)


def num_vocab_tiles(vocab_size: int, n: int) -> int:
    """Vocabulary tiles of the backward pass: the largest divisor of V not above n."""
    return max(m for m in range(1, min(n, vocab_size) + 1) if vocab_size % m == 0)


def _vocab_tiles(head, spec: str, m: int):
    """The head [D, V] ("dv") or [V, D] ("vd") as m tiles [m, D, U] / [m, U, D], tile j holding
    words j, j + m, …: a vocabulary split over `tensor` keeps its split inside every tile."""
    axis = spec.index("v")
    shape = head.shape[:axis] + (head.shape[axis] // m, m) + head.shape[axis + 1:]
    return jnp.moveaxis(head.reshape(shape), axis + 1, 0)


def _vocab_untiles(tiles, spec: str):
    axis = spec.index("v")
    x = jnp.moveaxis(tiles, 0, axis + 1)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _bwd(z_loss_weight, n, spec, softcap, res, cotangents):
    x_BTD, head, targets_BT, weights_BT, log_z_nBC = res
    g_loss, g_xent = cotangents
    m = num_vocab_tiles(head.shape[spec.index("v")], n)
    head_axes = tuple({"d": "embed", "v": "vocab"}[c] for c in spec)  # the head's own (mesh.RULES)
    log_z_BT = _unchunk(log_z_nBC)
    # d/dlogits of w·xent is w·(softmax − onehot); of w·log_z² it is 2·w·log_z·softmax
    scale_BT = weights_BT * (g_loss + g_xent + 2 * z_loss_weight * g_loss * log_z_BT)
    hit_BT = weights_BT * (g_loss + g_xent)
    tile_BT, word_BT = targets_BT % m, targets_BT // m  # the target's tile and its place in it
    dtype = x_BTD.dtype  # the forward products ran in x's dtype

    def body(dx_BTD, xs):
        j, head_tile = xs
        logits_BTU = _logits(x_BTD, head_tile, spec, softcap)
        probs_BTU = jnp.exp(logits_BTU - log_z_BT[..., None])
        onehot_BTU = jax.nn.one_hot(jnp.where(tile_BT == j, word_BT, -1), logits_BTU.shape[-1],
                                    dtype=jnp.float32)
        dlogits_BTU = probs_BTU * scale_BT[..., None] - onehot_BTU * hit_BT[..., None]
        if softcap:  # through c·tanh(z/c): d/dz = 1 − tanh²
            dlogits_BTU = dlogits_BTU * (1 - jnp.square(logits_BTU / softcap))
        dlogits_BTU = dlogits_BTU.astype(dtype)
        dx_BTD = dx_BTD + jnp.einsum(f"btv,{spec}->btd", dlogits_BTU,
                                     head_tile.astype(dtype), preferred_element_type=jnp.float32)
        # this tile's share of the head's gradient, summed over the batch's tokens and split like
        # the head at once: no device ever holds the whole [D, V] sum
        dhead_tile = jnp.einsum(f"btd,btv->{spec}", x_BTD, dlogits_BTU,
                                preferred_element_type=jnp.float32)
        return constrain(dx_BTD, BTD), constrain(dhead_tile, head_axes)

    dx0_BTD = constrain(jnp.zeros(x_BTD.shape, jnp.float32), BTD)
    dx_BTD, dhead_tiles = jax.lax.scan(body, dx0_BTD, (jnp.arange(m), _vocab_tiles(head, spec, m)))
    zeros_int = np.zeros(targets_BT.shape, jax.dtypes.float0)  # integer inputs: no gradient
    # rounded here, once: left to its consumers, the convert was fused into the layers' backward
    # pass, which then kept the float32 carry alive (0.25 GiB more in the pipelined 405B plan)
    dx_BTD = jax.lax.optimization_barrier(dx_BTD.astype(x_BTD.dtype))
    return (dx_BTD, _vocab_untiles(dhead_tiles, spec).astype(head.dtype), zeros_int,
            jnp.zeros_like(weights_BT))


chunked_loss_sums.defvjp(_fwd, _bwd)
