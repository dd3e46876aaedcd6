"""Cross-entropy (+ z-loss) of the output head without ever holding the [B, T, V] logits.

The sequence is cut into `num_vocab_tiling` chunks (MaxText's key); a scan computes each chunk's
logits [B, C, V], its log-partition and target logit, and keeps only sums. A chunk takes every
n-th token (chunk k: tokens k, k + n, k + 2n, …): the sums do not care about order, and a
sequence split over context shards stays split the same way inside every chunk (each device
computes its own tokens' logits, none gathers another's hidden states). The backward pass (a
custom VJP) recomputes each chunk's logits and turns them into the chunk's input gradient and its
share of the head's gradient, so peak memory holds one chunk of logits, never T·V per sequence.
The head comes as stored (`Transformer.head()`: the embedding table [V, D], spec "vd", when tied,
else [D, V], "dv") and its gradient leaves in that layout and dtype, accumulated in float32: never
a transposed bf16 dot result (XLA's CPU dot cannot produce one) nor a bf16-rounded sum.
Shape legend as in layers.py; C chunk length, n number of chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxlite.models.layers import constrain
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


def _bwd(z_loss_weight, n, spec, softcap, res, cotangents):
    x_BTD, head, targets_BT, weights_BT, log_z_nBC = res
    g_loss, g_xent = cotangents
    V = head.shape[spec.index("v")]
    head_c = head.astype(x_BTD.dtype)  # the forward products ran in x's dtype

    def body(dhead, xs):
        x_BCD, targets_BC, weights_BC, log_z_BC = xs
        logits_BCV = _logits(x_BCD, head, spec, softcap)
        probs_BCV = jnp.exp(logits_BCV - log_z_BC[..., None])
        # d/dlogits of w·xent is w·(softmax − onehot); of w·log_z² it is 2·w·log_z·softmax
        scale_BC = weights_BC * (g_loss + g_xent + 2 * z_loss_weight * g_loss * log_z_BC)
        onehot_BCV = jax.nn.one_hot(targets_BC, V, dtype=jnp.float32)
        dlogits_BCV = (probs_BCV * scale_BC[..., None]
                       - onehot_BCV * (weights_BC * (g_loss + g_xent))[..., None])
        if softcap:  # through c·tanh(z/c): d/dz = 1 − tanh²
            dlogits_BCV = dlogits_BCV * (1 - jnp.square(logits_BCV / softcap))
        dlogits_BCV = dlogits_BCV.astype(head_c.dtype)
        dx_BCD = jnp.einsum(f"bcv,{spec}->bcd", dlogits_BCV, head_c,
                            preferred_element_type=jnp.float32).astype(x_BCD.dtype)
        dhead = dhead + jnp.einsum(f"bcd,bcv->{spec}", x_BCD, dlogits_BCV,
                                   preferred_element_type=jnp.float32)
        return dhead, dx_BCD

    xs = (_chunks(x_BTD, n), _chunks(targets_BT, n), _chunks(weights_BT, n), log_z_nBC)
    dhead, dx_nBCD = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32), xs)
    zeros_int = np.zeros(targets_BT.shape, jax.dtypes.float0)  # integer inputs: no gradient
    return (_unchunk(dx_nBCD).astype(x_BTD.dtype), dhead.astype(head.dtype), zeros_int,
            jnp.zeros_like(weights_BT))


chunked_loss_sums.defvjp(_fwd, _bwd)
