"""The experts' MLP over rows sorted by expert: one gated MLP per group of consecutive rows.

    y[rows of group g] = down_g(glu(x · gate_g + gate_bias_g, x · up_g + up_bias_g))

`group_sizes_G` says how many rows each expert has, in order; rows past their sum (padding) come
out zero. Three spellings of the same products, the `moe_implementation` that sorts tokens:

  ragged    jax.lax.ragged_dot: XLA's grouped matmul (TPU, GPU); XLA:CPU runs it 10-400x slower
            than a dense matmul of the same work (it expands the groups), so CPU takes `blocked`
  blocked   each group padded to whole blocks of `block` rows, every block multiplied by its
            group's weights in one batched matmul: at most G·(block − 1) padding rows of extra
            work, the weights gathered once per block (what a CPU runs fast)
  megablox  the Pallas TPU grouped-matmul kernel (jax.experimental.pallas.ops.tpu.megablox) with
            its own backward kernels; elsewhere the Pallas interpreter runs it (tests only)

Shape legend as in layers.py, plus M rows, G groups (experts), F an expert's MLP width, n blocks
of b rows. Products in x's dtype, accumulated in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxlite.models.matmul import project
from maxlite.models.platform import target_platform

GROUPED = ("ragged", "blocked", "megablox")
MEGABLOX_TILE = 128  # the kernel's m, k and n tiles (capped at each dimension)


def _row_bias(h_MF, bias_GF, group_M):
    """h + each row's group's bias (None: h)."""
    return h_MF if bias_GF is None else h_MF + jnp.take(bias_GF, group_M, axis=0).astype(h_MF.dtype)


def ffn(impl: str, x_MD, group_sizes_G, gate_GDF, up_GDF, down_GFD, glu, gate_bias_GF=None, up_bias_GF=None):
    """The gated MLP of each row's group (with gpt-oss's gate and up biases when given); rows past
    sum(group_sizes_G) give zeros."""
    if impl == "blocked":
        return _blocked(x_MD, group_sizes_G, gate_GDF, up_GDF, down_GFD, glu, gate_bias_GF, up_bias_GF)
    assert impl in GROUPED, impl
    dot = _ragged_dot if impl == "ragged" else _megablox
    M, G = x_MD.shape[0], group_sizes_G.shape[0]
    real_M1 = (jnp.arange(M) < jnp.sum(group_sizes_G))[:, None]
    group_M = jnp.clip(jnp.searchsorted(jnp.cumsum(group_sizes_G), jnp.arange(M), side="right"), 0, G - 1)
    # the kernels leave padding rows unwritten, forward and backward: select them away both ways
    x_MD = jnp.where(real_M1, x_MD, 0)
    h_MF = glu(_row_bias(dot(x_MD, gate_GDF, group_sizes_G), gate_bias_GF, group_M),
               _row_bias(dot(x_MD, up_GDF, group_sizes_G), up_bias_GF, group_M))
    return jnp.where(real_M1, dot(h_MF, down_GFD, group_sizes_G), 0)


def _ragged_dot(x_MK, w_GKN, group_sizes_G):
    return jax.lax.ragged_dot(x_MK, w_GKN.astype(x_MK.dtype), group_sizes_G,
                              preferred_element_type=jnp.float32).astype(x_MK.dtype)


def _megablox(x_MK, w_GKN, group_sizes_G):
    from jax.experimental.pallas.ops.tpu.megablox import ops

    M, K = x_MK.shape
    N = w_GKN.shape[2]
    tm = min(MEGABLOX_TILE, M)
    pad = -M % tm
    x = jnp.pad(x_MK, ((0, pad), (0, 0))) if pad else x_MK
    out = ops.gmm(x, w_GKN.astype(x_MK.dtype), group_sizes_G.astype(jnp.int32), x_MK.dtype,
                  (tm, min(MEGABLOX_TILE, K), min(MEGABLOX_TILE, N)), None, None, False,
                  target_platform() != "tpu")
    return out[:M]


def block_rows(M: int, G: int) -> int:
    """`blocked`'s block: a power of two near a quarter of the mean group (padding ≤ ~25% of the
    rows), between 8 and 256 rows."""
    return max(8, min(256, 1 << max(0, int(math.log2(max(1, M // (4 * G)))))))


def _blocked(x_MD, group_sizes_G, gate_GDF, up_GDF, down_GFD, glu, gate_bias_GF=None, up_bias_GF=None):
    M, D = x_MD.shape
    G = group_sizes_G.shape[0]
    b = block_rows(M, G)
    n = -(-(M + G * (b - 1)) // b)  # blocks enough for any group sizes summing to ≤ M
    padded_G = -(-group_sizes_G // b) * b
    start_G = jnp.cumsum(group_sizes_G) - group_sizes_G
    pstart_G = jnp.cumsum(padded_G) - padded_G
    row_M = jnp.arange(M)
    group_M = jnp.clip(jnp.searchsorted(jnp.cumsum(group_sizes_G), row_M, side="right"), 0, G - 1)
    real_M = row_M < jnp.sum(group_sizes_G)
    slot_M = jnp.where(real_M, pstart_G[group_M] + row_M - start_G[group_M], n * b)  # n·b: dropped
    x_nbD = jnp.zeros((n * b, D), x_MD.dtype).at[slot_M].set(x_MD, mode="drop").reshape(n, b, D)
    # each block's group (blocks past the last group's are zero rows: any group will do)
    group_n = jnp.clip(jnp.searchsorted(jnp.cumsum(padded_G), jnp.arange(n) * b, side="right"), 0, G - 1)
    gate_nDF, up_nDF, down_nFD = (jnp.take(w, group_n, axis=0) for w in (gate_GDF, up_GDF, down_GFD))
    h_nbF = glu(_row_bias(project("nbd,ndf->nbf", x_nbD, gate_nDF), gate_bias_GF, group_n[:, None]),
                _row_bias(project("nbd,ndf->nbf", x_nbD, up_nDF), up_bias_GF, group_n[:, None]))
    y_nbD = project("nbf,nfd->nbd", h_nbF, down_nFD)
    y_MD = jnp.take(y_nbD.reshape(n * b, D), jnp.minimum(slot_M, n * b - 1), axis=0)
    return jnp.where(real_M[:, None], y_MD, 0)
