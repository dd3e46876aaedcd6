"""The gated delta rule's chunked form, forward and backward, on XLA:CPU: one chunk at a time
(maxlite/models/gated_deltanet.py) against every chunk at once (the form before, kept below)
→ benchmarks/results/delta_rule.json.

    JAX_PLATFORMS=cpu python benchmarks/bench_delta_rule.py [--lengths 1024 4096]

Kimi delta attention's shape (per-channel decay, heads of 128, chunks of 64: Kimi-Linear-48B) with 8
heads instead of 32 (a CPU's memory), and the gated delta-net's (per-head decay, Qwen3.5's heads of
128), 2 sequences of each length, one segment. For each: the compiled program's temporaries
(`memory_analysis().temp_size_in_bytes`), the seconds of one forward + backward (the median of 3
after a warm-up), and the objective (the same rule: equal up to float32 rounding).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks._fwd_bwd import fwd_bwd  # noqa: E402
from benchmarks._results import write_result  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from maxlite.models.gated_deltanet import unit_lower_inverse  # noqa: E402,F401 (the reference's)

OUT = ROOT / "benchmarks" / "results" / "delta_rule.json"


def whole_sequence_delta_rule(q_BTME, k_BTME, v_BTMU, g_BTM, beta_BTM, seg_BT, state_BMEU=None, chunk: int = 64):
    """maxlite/models/gated_deltanet.py's chunked_delta_rule before 2026-12-06, kept here as the
    benchmark's reference: every chunk's decays and WY solve at once ([n, B, M, C, C] float32, Kimi's
    per-channel [n, B, M, C, C, E]), then the scan over chunks."""
    f32 = jnp.float32
    B, T, M, E = q_BTME.shape
    U = v_BTMU.shape[-1]
    C = chunk
    pad = -T % C
    n = (T + pad) // C

    def blocks(x):  # [B, T, M, X] → [n, B, M, C, X]; [B, T, M] → [n, B, M, C]
        x = jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, C, *x.shape[2:])
        return x.transpose(1, 0, 3, 2, 4) if x.ndim == 5 else x.transpose(1, 0, 3, 2)

    q, k, v = (blocks(x) for x in (q_BTME, k_BTME, v_BTMU))          # [n, B, M, C, E|U]
    g, beta = (blocks(x) for x in (g_BTM, beta_BTM))                  # [n, B, M, C] (g: [.., C, E] per channel)
    seg = jnp.moveaxis(jnp.pad(seg_BT, [(0, 0), (0, pad)], mode="edge").reshape(B, n, C), 1, 0)  # [n, B, C]
    # the segment the state entering each chunk belongs to: the last token's of the chunk before
    seg_in = jnp.concatenate([seg[:1, :, 0], seg[:-1, :, -1]], axis=0)  # [n, B]

    same = (seg[..., :, None] == seg[..., None, :])[:, :, None]       # [n, B, 1, C, C]
    causal = jnp.tril(jnp.ones((C, C), bool))
    live = same & causal
    first = (seg == seg_in[..., None])[:, :, None]                    # [n, B, 1, C]: sees the entering state
    last = (seg == seg[..., -1:])[:, :, None]                         # shares the chunk's last segment
    k_beta = k * beta[..., None]
    if g.ndim == 5:  # per channel (KDA): each key dim its own decay, exp(γ_i − γ_j) [.., C, C, E] in the sums
        gamma = jnp.cumsum(g, axis=-2)                                # [n, B, M, C, E]
        live_e = live[..., None]
        diff = gamma[..., :, None, :] - gamma[..., None, :, :]
        decay = jnp.where(live_e, jnp.exp(jnp.where(live_e, diff, 0.0)), 0.0)
        strict = jnp.einsum("nbmie,nbmje,nbmije->nbmij", k_beta, k, decay) * ~jnp.eye(C, dtype=bool)
        intra = jnp.einsum("nbmie,nbmje,nbmije->nbmij", q, k, decay)
        g_in = jnp.exp(gamma) * first[..., None]                      # decay from the chunk's start
        g_out = jnp.exp(gamma[..., -1:, :] - gamma) * last[..., None]  # decay to the chunk's end
        carry_decay = (jnp.exp(gamma[..., -1, :]) * first[..., -1][..., None])[..., None]  # [n, B, M, E, 1]
    else:
        gamma = jnp.cumsum(g, axis=-1)                                # [n, B, M, C]
        diff = gamma[..., :, None] - gamma[..., None, :]
        decay = jnp.where(live, jnp.exp(jnp.where(live, diff, 0.0)), 0.0)  # exp(γ_i − γ_j), j ≤ i, one segment
        strict = jnp.einsum("nbmie,nbmje->nbmij", k_beta, k) * decay * ~jnp.eye(C, dtype=bool)
        intra = jnp.einsum("nbmie,nbmje->nbmij", q, k) * decay
        g_in = (jnp.exp(gamma) * first)[..., None]
        g_out = (jnp.exp(gamma[..., -1:] - gamma) * last)[..., None]
        carry_decay = (jnp.exp(gamma[..., -1]) * first[..., -1])[..., None, None]  # [n, B, M, 1, 1]

    eye = jnp.eye(C, dtype=f32)
    rhs = jnp.concatenate([v * beta[..., None], k_beta * g_in], axis=-1)
    solved = jnp.einsum("...ij,...jk->...ik", unit_lower_inverse(eye + strict), rhs)
    u, w = solved[..., :U], solved[..., U:]                           # [n, B, M, C, U], [.., E]
    q_in = q * g_in
    k_out = k * g_out

    def step(S_BMEU, xs):
        u, w, q_in, intra, k_out, carry_decay = xs
        v_new = u - jnp.einsum("bmce,bmeu->bmcu", w, S_BMEU)
        o = jnp.einsum("bmce,bmeu->bmcu", q_in, S_BMEU) + jnp.einsum("bmij,bmju->bmiu", intra, v_new)
        S_BMEU = S_BMEU * carry_decay + jnp.einsum("bmce,bmcu->bmeu", k_out, v_new)
        return S_BMEU, o

    S0 = jnp.zeros((B, M, E, U), f32) if state_BMEU is None else state_BMEU.astype(f32)
    S, o = jax.lax.scan(step, S0, (u, w, q_in, intra, k_out, carry_decay))  # o [n, B, M, C, U]
    o_BTMU = o.transpose(1, 0, 3, 2, 4).reshape(B, n * C, M, U)[:, :T]
    return o_BTMU, S


def measure(rule, T: int, per_channel: bool, M: int = 8, E: int = 128, B: int = 2) -> dict:
    keys = jax.random.split(jax.random.key(0), 5)
    unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True))  # noqa: E731
    q, k = unit(jax.random.normal(keys[0], (B, T, M, E))) * E ** -0.5, unit(jax.random.normal(keys[1], (B, T, M, E)))
    v = jax.random.normal(keys[2], (B, T, M, E))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (B, T, M, E) if per_channel else (B, T, M)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, M)))
    seg = jnp.ones((B, T), jnp.int32)
    return {"tokens": T, "heads": M, "decay": "per channel (KDA)" if per_channel else "per head (gated delta-net)",
            **fwd_bwd(lambda q, k, v, g: jnp.sum(rule(q, k, v, g, beta, seg)[0] ** 2), q, k, v, g)}


def main() -> int:
    from maxlite.models.gated_deltanet import chunked_delta_rule

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--out", type=pathlib.Path, default=OUT)
    args = ap.parse_args()
    rows = []
    for per_channel in (True, False):
        for T in args.lengths:
            for name, rule in (("every chunk at once (before)", whole_sequence_delta_rule),
                               ("one chunk at a time", chunked_delta_rule)):
                rows.append({"form": name, **measure(rule, T, per_channel)})
                r = rows[-1]
                print(f"{r['decay']}, {T} tokens, {name}: {r['temp_mib']} MiB of temporaries, {r['fwd_bwd_s']} s",
                      file=sys.stderr, flush=True)
    write_result({"what": "the gated delta rule's chunked form, forward + backward, XLA:CPU",
                  "cpu_count": os.cpu_count(), "results": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
