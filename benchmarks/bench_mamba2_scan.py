"""Mamba-2's chunked scan, forward and backward, on XLA:CPU: one chunk at a time (maxlite/models/mamba2.py)
against every chunk at once (the form before, kept below) → benchmarks/results/mamba2_scan.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_mamba2_scan.py [--lengths 2048 8192]

Nemotron-H 8B's head shape (P = 64, S = 128, 8 groups) with 32 heads instead of 128 (a CPU's memory):
2 sequences of each length, one segment. For each form: the compiled program's temporaries
(`memory_analysis().temp_size_in_bytes`: what the quadratic forms hold), the seconds of one
forward + backward (the median of 3 after a warm-up), and the value of the objective (the same
scan: equal up to float32 rounding).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._fwd_bwd import fwd_bwd  # noqa: E402
from benchmarks._results import write_result  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "mamba2_scan.json"


def whole_sequence_scan(x_BTMP, dt_BTM, A_M, B_BTGS, C_BTGS, seg_BT, state_BMPS=None, chunk: int = 128):
    """maxlite/models/mamba2.py's chunked_scan before 2026-12-06, kept here as the benchmark's
    reference: every chunk's quadratic form at once ([n, B, M, C, C] float32), C·Bᵀ repeated from
    the groups to the heads."""
    f32 = jnp.float32
    B, T, M, P = x_BTMP.shape
    G, S = B_BTGS.shape[2:]
    C = chunk
    pad = -T % C
    n = (T + pad) // C

    def blocks(x):  # [B, T, H, X] → [n, B, H, C, X]; [B, T, H] → [n, B, H, C]
        x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, C, *x.shape[2:])
        return x.transpose(1, 0, 3, 2, 4) if x.ndim == 5 else x.transpose(1, 0, 3, 2)

    x, dt, Bg, Cg = blocks(x_BTMP), blocks(dt_BTM), blocks(B_BTGS), blocks(C_BTGS)
    seg = jnp.moveaxis(jnp.pad(seg_BT, [(0, 0), (0, pad)], mode="edge").reshape(B, n, C), 1, 0)  # [n, B, C]
    seg_in = jnp.concatenate([seg[:1, :, 0], seg[:-1, :, -1]], axis=0)  # the entering state's segment [n, B]

    gamma = jnp.cumsum(dt * A_M.astype(f32)[:, None], axis=-1)          # [n, B, M, C]
    live = ((seg[..., :, None] == seg[..., None, :]) & jnp.tril(jnp.ones((C, C), bool)))[:, :, None]
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay = jnp.where(live, jnp.exp(jnp.where(live, diff, 0.0)), 0.0)  # exp(γ_i − γ_j), j ≤ i, one segment
    first = (seg == seg_in[..., None])[:, :, None]                      # [n, B, 1, C]: sees the entering state
    last = (seg == seg[..., -1:])[:, :, None]                           # shares the chunk's last segment

    heads = M // G  # head m reads group m // heads
    CB = jnp.repeat(jnp.einsum("nbgis,nbgjs->nbgij", Cg, Bg), heads, axis=2)  # [n, B, M, C, C]
    Bh, Ch = jnp.repeat(Bg, heads, axis=2), jnp.repeat(Cg, heads, axis=2)     # [n, B, M, C, S]
    xdt = x * dt[..., None]                                             # [n, B, M, C, P]
    intra = jnp.einsum("nbmij,nbmjp->nbmip", CB * decay, xdt)
    C_in = Ch * (jnp.exp(gamma) * first)[..., None]
    B_out = Bh * (jnp.exp(gamma[..., -1:] - gamma) * last)[..., None]
    carry_decay = (jnp.exp(gamma[..., -1]) * first[..., -1])[..., None, None]  # [n, B, M, 1, 1]

    def step(h_BMPS, xs):
        intra, C_in, B_out, xdt, carry_decay = xs
        y = intra + jnp.einsum("bmcs,bmps->bmcp", C_in, h_BMPS)
        h_BMPS = h_BMPS * carry_decay + jnp.einsum("bmcs,bmcp->bmps", B_out, xdt)
        return h_BMPS, y

    h0 = jnp.zeros((B, M, P, S), f32) if state_BMPS is None else state_BMPS.astype(f32)
    h, y = jax.lax.scan(step, h0, (intra, C_in, B_out, xdt, carry_decay))  # y [n, B, M, C, P]
    return y.transpose(1, 0, 3, 2, 4).reshape(B, n * C, M, P)[:, :T], h


def measure(scan, T: int, M: int = 32, P: int = 64, G: int = 8, S: int = 128, B: int = 2) -> dict:
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (B, T, M, P))
    dt = jax.nn.softplus(jax.random.normal(keys[1], (B, T, M)))
    A = -jnp.exp(jax.random.normal(keys[2], (M,)))
    B_ = jax.random.normal(keys[3], (B, T, G, S))
    C_ = jax.random.normal(keys[4], (B, T, G, S))
    seg = jnp.ones((B, T), jnp.int32)
    return {"tokens": T, "heads": M,
            **fwd_bwd(lambda x, dt, b, c: jnp.sum(scan(x, dt, A, b, c, seg)[0] ** 2), x, dt, B_, C_)}


def main() -> int:
    from maxlite.models.mamba2 import chunked_scan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    rows = []
    for T in args.lengths:
        for name, scan in (("every chunk at once (before)", whole_sequence_scan), ("one chunk at a time", chunked_scan)):
            rows.append({"form": name, **measure(scan, T)})
            r = rows[-1]
            print(f"{T} tokens, {name}: {r['temp_mib']} MiB of temporaries, {r['fwd_bwd_s']} s", file=sys.stderr, flush=True)
    write_result({"what": "Mamba-2's chunked scan, forward + backward, XLA:CPU", "cpu_count": __import__("os").cpu_count(),
                  "results": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
