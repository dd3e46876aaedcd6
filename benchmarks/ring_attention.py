"""Ring attention, a prototype measured against maxlite's all-gather of K/V (benchmarks/bench_context.py;
the choice and its measurements: docs/long-context.md). Not used by training.

Each context shard keeps its queries and passes its K/V chunk (and, in the backward pass, the dK/dV
accumulated for it) to the next shard with `jax.lax.ppermute`, n steps around the ring: no shard
ever holds more than its own chunk plus the one in flight. Every step combines the shard's queries
with the visiting chunk by online softmax (the running max, sum and weighted values, as flash
attention does across key blocks), itself blockwise over key blocks of `block` tokens. The backward
pass is hand-written (flash-attention-2: recompute the probabilities from the saved log-sum-exp)
so that memory stays O(T/n) per device. Layouts as in maxlite/models/context.py: sequence order or
the load-balanced one (shard s holds chunks s and 2n−1−s); a pair (query chunk, key chunk) with no
visible key is skipped (`lax.cond` per shard), so with load balance every ring step does the same
work on every shard. Causal, packed documents (segment ids), sliding windows, GQA.

    python benchmarks/ring_attention.py     # checks ring == all-gather == one device on small shapes
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import sys
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
if __name__ == "__main__":  # before JAX is imported
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from maxlite.models import context  # noqa: E402
from maxlite.models.attention import _NEG, visible  # noqa: E402


class Ring(NamedTuple):
    """The static choices of one ring (hashable: a custom_vjp's non-differentiable argument)."""
    axes: tuple
    n: int
    balanced: bool
    window: int
    block: int
    scale: float


def ring_attend(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, is_balanced: bool, window: int = 0, block: int = 512,
                scale: float | None = None):
    """Attention with the sequence split over the context axes of the active mesh and rules, the
    inputs in the step's layout (balanced or not), K/V passed around the ring."""
    mesh = jax.sharding.get_abstract_mesh()
    axes, n = context.length_axes(), context.shards()
    T_local = q_BTNH.shape[1] // n
    piece = T_local // 2 if is_balanced else T_local
    ring = Ring(axes, n, is_balanced, window, min(block, piece),
                1.0 / math.sqrt(q_BTNH.shape[-1]) if scale is None else scale)
    q_spec = context._spec("activation_batch", "activation_length", "activation_heads", None)
    kv_spec = context._spec("activation_batch", "activation_length", "activation_kv_heads", None)
    seg_spec = context._spec("activation_batch", "activation_length")

    def body(q, k, v, seg):
        return _ring(q, k, v, seg, jax.lax.axis_index(axes), ring)

    return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec,
                         check_vma=False)(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)


def _pass(ring: Ring, *xs):
    """Every x to the next shard of the ring (shard j → j + 1)."""
    perm = [(j, (j + 1) % ring.n) for j in range(ring.n)]
    return tuple(jax.lax.ppermute(x, ring.axes, perm) for x in xs)


def _reaches(qc: context.Chunk, kc: context.Chunk, window: int):
    """Whether any query of chunk qc sees any key of chunk kc (traced)."""
    q_last, k_last = qc.first + qc.length - 1, kc.first + kc.length - 1
    ok = kc.first <= q_last
    return ok if not window else ok & (qc.first - k_last < window)


def _key_blocks(ring: Ring, k_BLKH, v_BLKH, kseg_BL, kpos_L):
    """[B, L, ...] → [L/C, B, C, ...] (the scan's leading axis), and the positions [L/C, C]."""
    C = ring.block
    blocks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], -1, C, *x.shape[2:]), 1, 0)  # noqa: E731
    return blocks(k_BLKH), blocks(v_BLKH), blocks(kseg_BL), kpos_L.reshape(-1, C)


def _scores(ring: Ring, q_BQKGH, k_BCKH, qseg_BQ, kseg_BC, qpos_Q, kpos_C):
    """Scaled f32 scores [B, K, G, Q, C], masked, and the mask."""
    s = jnp.einsum("bqkgh,bckh->bkgqc", q_BQKGH, k_BCKH).astype(jnp.float32) * ring.scale
    mask_BQC = (visible(qpos_Q[:, None], kpos_C[None, :], ring.window)[None]
                & (qseg_BQ[:, :, None] == kseg_BC[:, None, :]))
    mask = mask_BQC[:, None, None]
    return jnp.where(mask, s, _NEG), mask


def _pair_fwd(ring: Ring, state, q_BQKGH, qseg_BQ, qpos_Q, k_BLKH, v_BLKH, kseg_BL, kpos_L):
    """The online-softmax state (m, l, acc) of a query chunk after a key chunk, block by block."""

    def block(carry, xs):
        m, l, acc = carry
        k, v, kseg, kpos = xs
        s, mask = _scores(ring, q_BQKGH, k, qseg_BQ, kseg, qpos_Q, kpos)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        correction = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqc,bckh->bkgqh", p.astype(v.dtype), v).astype(jnp.float32)
        return (m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv), None

    return jax.lax.scan(block, state, _key_blocks(ring, k_BLKH, v_BLKH, kseg_BL, kpos_L))[0]


def _pair_bwd(ring: Ring, dq_BQKGH, q_BQKGH, dout_BQKGH, lse_BKGQ, delta_BKGQ, qseg_BQ, qpos_Q,
              k_BLKH, v_BLKH, kseg_BL, kpos_L):
    """dq of a query chunk (accumulated) and the chunk's contributions to dk, dv of a key chunk."""
    q32 = q_BQKGH.astype(jnp.float32)

    def block(dq, xs):
        k, v, kseg, kpos = xs
        s, mask = _scores(ring, q_BQKGH, k, qseg_BQ, kseg, qpos_Q, kpos)
        p = jnp.where(mask, jnp.exp(s - lse_BKGQ[..., None]), 0.0)
        dp = jnp.einsum("bqkgh,bckh->bkgqc", dout_BQKGH, v.astype(jnp.float32))
        ds = p * (dp - delta_BKGQ[..., None]) * ring.scale
        dq = dq + jnp.einsum("bkgqc,bckh->bqkgh", ds, k.astype(jnp.float32))
        return dq, (jnp.einsum("bkgqc,bqkgh->bckh", ds, q32), jnp.einsum("bkgqc,bqkgh->bckh", p, dout_BQKGH))

    dq, (dk, dv) = jax.lax.scan(block, dq_BQKGH, _key_blocks(ring, k_BLKH, v_BLKH, kseg_BL, kpos_L))
    unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])  # noqa: E731
    return dq, unblock(dk), unblock(dv)


def _rows(x, c: context.Chunk):
    return x[:, c.start:c.start + c.length]


def _positions(c: context.Chunk):
    return c.first + jnp.arange(c.length)


def _ring_fwd(q_BTNH, k_BTKH, v_BTKH, seg_BT, index, ring: Ring):
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    q = q_BTNH.reshape(B, T, K, N // K, H)
    q_chunks = context.shard_chunks(T, ring.n, ring.balanced, index)
    states = [(jnp.full((B, K, N // K, c.length), _NEG, jnp.float32), jnp.zeros((B, K, N // K, c.length), jnp.float32),
               jnp.zeros((B, K, N // K, c.length, H), jnp.float32)) for c in q_chunks]
    k, v, kseg = k_BTKH, v_BTKH, seg_BT
    for i in range(ring.n):  # unrolled: n is small, and the last step passes nothing on
        k_chunks = context.shard_chunks(T, ring.n, ring.balanced, (index - i) % ring.n)
        for a, qc in enumerate(q_chunks):
            for kc in k_chunks:
                args = (_rows(q, qc), _rows(seg_BT, qc), _positions(qc), _rows(k, kc), _rows(v, kc), _rows(kseg, kc),
                        _positions(kc))
                states[a] = jax.lax.cond(_reaches(qc, kc, ring.window),
                                         lambda s, *a: _pair_fwd(ring, s, *a), lambda s, *a: s, states[a], *args)
        if i < ring.n - 1:
            k, v, kseg = _pass(ring, k, v, kseg)
    outs, lses = [], []
    for m, l, acc in states:
        outs.append(jnp.transpose(acc / l[..., None], (0, 3, 1, 2, 4)))  # every row sees its own diagonal: l > 0
        lses.append(m + jnp.log(l))
    out = jnp.concatenate(outs, axis=1).reshape(B, T, N, H).astype(q_BTNH.dtype)
    return out, (q_BTNH, k_BTKH, v_BTKH, seg_BT, index, out, lses)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q_BTNH, k_BTKH, v_BTKH, seg_BT, index, ring: Ring):
    return _ring_fwd(q_BTNH, k_BTKH, v_BTKH, seg_BT, index, ring)[0]


def _ring_bwd(ring: Ring, res, dout_BTNH):
    q_BTNH, k_BTKH, v_BTKH, seg_BT, index, out_BTNH, lses = res
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    q = q_BTNH.reshape(B, T, K, N // K, H)
    dout = dout_BTNH.reshape(q.shape).astype(jnp.float32)
    delta = jnp.einsum("btkgh,btkgh->bkgt", dout, out_BTNH.reshape(q.shape).astype(jnp.float32))
    q_chunks = context.shard_chunks(T, ring.n, ring.balanced, index)
    dqs = [jnp.zeros((B, c.length, K, N // K, H), jnp.float32) for c in q_chunks]
    k, v, kseg = k_BTKH, v_BTKH, seg_BT
    dk, dv = (jnp.zeros(x.shape, jnp.float32) for x in (k_BTKH, v_BTKH))  # travel with their chunk
    for i in range(ring.n):
        k_chunks = context.shard_chunks(T, ring.n, ring.balanced, (index - i) % ring.n)
        for a, qc in enumerate(q_chunks):
            for kc in k_chunks:
                rows = slice(qc.start, qc.start + qc.length)
                args = (_rows(q, qc), _rows(dout, qc), lses[a], delta[..., rows], _rows(seg_BT, qc), _positions(qc),
                        _rows(k, kc), _rows(v, kc), _rows(kseg, kc), _positions(kc))
                zeros = jnp.zeros((B, kc.length, K, H), jnp.float32)
                dqs[a], dk_c, dv_c = jax.lax.cond(_reaches(qc, kc, ring.window),
                                                  lambda dq, *a: _pair_bwd(ring, dq, *a),
                                                  lambda dq, *a: (dq, zeros, zeros), dqs[a], *args)
                cols = slice(kc.start, kc.start + kc.length)
                dk, dv = dk.at[:, cols].add(dk_c), dv.at[:, cols].add(dv_c)
        if i < ring.n - 1:
            k, v, kseg, dk, dv = _pass(ring, k, v, kseg, dk, dv)
        else:  # n passes in all bring each chunk's dK/dV home
            dk, dv = _pass(ring, dk, dv)
    dq = jnp.concatenate(dqs, axis=1).reshape(q_BTNH.shape)
    ints = [jax.numpy.zeros(x.shape, jax.dtypes.float0) for x in (seg_BT, index)]
    return dq.astype(q_BTNH.dtype), dk.astype(k_BTKH.dtype), dv.astype(v_BTKH.dtype), *ints


_ring.defvjp(_ring_fwd, _ring_bwd)


def _check() -> None:
    """ring == all-gather (maxlite's blockwise across shards) == dot_product on one device: values and
    dq/dk/dv, 4 shards, two packed rows of three documents, GQA, with and without load balance and
    a window."""
    import numpy as np
    from flax import nnx

    from maxlite import config as C, mesh as mesh_lib
    from maxlite.models import attention

    B, T, N, K, H, n = 2, 64, 4, 2, 16, 4
    keys = jax.random.split(jax.random.key(0), 4)
    q, dout = (jax.random.normal(k, (B, T, N, H)) for k in (keys[0], keys[3]))
    k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in keys[1:3])
    seg = np.ones((B, T), np.int32)
    seg[0, 13:40], seg[0, 40:], seg[1, 30:] = 2, 3, 2
    seg = jnp.asarray(seg)
    worst = 0.0
    for balance, window in ((True, 0), (True, 12), (False, 0), (False, 12)):
        ref = jax.vjp(lambda q, k, v: attention.dot_product(q, k, v, seg, window=window), q, k, v)
        ref = (ref[0], ref[1](dout))
        cfg = C.load(["base.yml", "attention=blockwise", "attention_block_size=4", f"max_target_length={T}",
                      f"context_parallel_load_balance={balance}"])
        mesh_cfg = C.resolve(C.load(["base.yml", f"ici_context_parallelism={n}", "ici_fsdp_parallelism=1",
                                     f"max_target_length={T}", f"per_device_batch_size={B / n}"]), n)
        mesh = mesh_lib.make_mesh(mesh_cfg, jax.devices()[:n])
        with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
            to, back = ((lambda x: context.to_balanced(x, n), lambda x: context.from_balanced(x, n)) if balance
                        else (lambda x: x, lambda x: x))
            for name, attend in (("all_gather", lambda *a: attention.attend(cfg, *a, window=window)),
                                 ("ring", lambda *a: ring_attend(*a, balance, window=window, block=4))):
                def run(q, k, v, d, attend=attend):
                    out, vjp = jax.vjp(lambda q, k, v: back(attend(to(q), to(k), to(v), to(seg))), q, k, v)
                    return out, vjp(d)
                got = jax.jit(run)(q, k, v, dout)
                for g, r, what in zip(jax.tree.leaves(got), jax.tree.leaves(ref), ("out", "dq", "dk", "dv")):
                    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5,
                                               err_msg=f"{name} {what} {balance=} {window=}")
                    worst = max(worst, float(jnp.max(jnp.abs(g - r))))
    print(f"ring and all-gather equal one device's dot_product (values, dq, dk, dv): max |diff| {worst:.2e}")


if __name__ == "__main__":
    _check()
