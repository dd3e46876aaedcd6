"""A mixture of experts against the dense model with the same active parameters, on this CPU: where
the MoE step's time goes.

    JAX_PLATFORMS=cpu python benchmarks/bench_moe_cpu.py [--repeats 5] [--steps 3] [--out FILE]

Two parts, each timed in process CPU seconds (all threads; on a shared machine wall time mostly
measures the other tenants) and wall seconds, the variants interleaved repeat by repeat so that a
change in the machine's load hits them alike:

  step   one train step (forward, backward, AdamW) of `tiny` and `tiny-moe` (the autoselected,
         dropless implementation: `blocked` on CPU; and with capacity_factor 1.25, `capacity`,
         which drops tokens), per_device_batch_size 8 × 256 tokens, 1 device
  layer  one MoE layer's pieces, forward + backward, at tiny-moe's size (2,048 tokens, D 256, 8
         experts of F 384, top 2, bfloat16): the dense MLP of the same active width (2F), the
         routing (+ the auxiliary loss), the sort by expert and back, the blocked expert MLP, and
         the blocked MLP's batched matmuls alone (weights already gathered per block) and the
         same rows as one unbatched matmul per projection; and the formulations tried against
         `blocked`: ragged_dot, and blocked with blocks of 64 and 256 rows

The machine's load (/proc/loadavg) is recorded before and after. Writes JSON (default
benchmarks/results/train_tiny-moe_vs_tiny_interleaved.json).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks._results import write_result  # noqa: E402

STEP = ["base.yml", "dataset_type=synthetic", "per_device_batch_size=8", "enable_checkpointing=false",
        "remat_policy=none"]
MODELS = {"tiny": ["model_name=tiny"], "tiny-moe": ["model_name=tiny-moe"],
          "tiny-moe capacity_factor=1.25": ["model_name=tiny-moe", "capacity_factor=1.25"]}


def _load() -> list[float]:
    return [float(x) for x in open("/proc/loadavg").read().split()[:3]]


def _cpu_flags() -> str:
    return next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("flags")), "")


def _interleaved(fns: dict, repeats: int, inner: int = 1) -> dict:
    """{name: {"cpu_s": [...], "wall_s": [...]}} per call, fns[name]() run `inner` times a repeat."""
    import jax

    out = {n: {"cpu_s": [], "wall_s": []} for n in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c, w = time.process_time(), time.perf_counter()
            for _ in range(inner):
                result = fn()
            jax.block_until_ready(result)
            out[name]["cpu_s"].append((time.process_time() - c) / inner)
            out[name]["wall_s"].append((time.perf_counter() - w) / inner)
    return out


def step_fns() -> tuple[dict, dict]:
    """name → a function running one train step (state carried between calls), and each's choice."""
    import jax
    from flax import nnx

    from maxlite import build as build_lib, config as C, mesh as mesh_lib
    from maxlite.data.synthetic import make_synthetic_iterator
    from maxlite.models.names import resolve_moe

    fns, chosen = {}, {}
    for name, overrides in MODELS.items():
        built = build_lib.build(C.load(STEP + overrides), jax.devices()[:1], num_processes=1)
        data = make_synthetic_iterator(built.cfg, "train", 0, 1)
        batch = {k: jax.device_put(v, built.batch_sharding) for k, v in next(data).items()}
        box = {"state": built.init_state()}

        def run(built=built, batch=batch, box=box):
            with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.RULES):
                box["state"], metrics = built.train_step(box["state"], batch)
            return metrics["loss"]

        jax.block_until_ready(run())  # compile
        fns[name] = run
        cfg = built.cfg
        chosen[name] = resolve_moe(cfg.moe_implementation, "cpu", cfg.capacity_factor) if cfg.num_experts else "-"
    return fns, chosen


def layer_fns() -> dict:
    """name → a compiled forward + backward of one MoE layer's piece at tiny-moe's size."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from maxlite import config as C
    from maxlite.models import grouped, moe, moe_kernels, moe_parallel
    from maxlite.models.matmul import project

    cfg = C.load(["base.yml", "model_name=tiny-moe"])
    B, T, D, E, F, k = 8, cfg.max_target_length, cfg.base_emb_dim, cfg.num_experts, cfg.base_moe_mlp_dim, \
        cfg.num_experts_per_tok
    rng = np.random.default_rng(0)
    dt, f32 = jnp.bfloat16, jnp.float32

    def normal(*shape, dtype=f32, scale=0.05):
        return jnp.asarray(rng.normal(size=shape) * scale, dtype)

    x, valid = normal(B, T, D, dtype=dt, scale=1.0), jnp.ones((B, T), bool)
    router, gate, up, down = normal(D, E), normal(E, D, F), normal(E, D, F), normal(E, F, D)
    act = jax.nn.silu
    glu = lambda g, u: act(g) * u  # noqa: E731 (the experts' gated hidden, as moe.py passes it)

    def routing(x, router):
        r = moe.route(cfg, x, router, None, valid, 0)
        return r, moe.aux_losses(cfg, jax.tree.map(lambda a: a[None], r.stats))["moe_lb_loss"]

    def dense_mlp(x, wg, wu, wd):
        return project("btf,fd->btd", act(project("btd,df->btf", x, wg)) * project("btd,df->btf", x, wu), wd)

    def route_only(x, router):
        r, aux = routing(x, router)
        return x * jnp.sum(r.weights_BTk, -1, keepdims=True).astype(dt), aux

    def sort_only(x, router):
        r, _ = routing(x, router)
        order_M, _ = moe_kernels.sort_by_expert(r.experts_BTk, E)
        x_MD = jnp.take(x.reshape(B * T, D), order_M // k, axis=0)
        return moe_kernels.combine(moe_kernels.unsort(x_MD, order_M, k), r.weights_BTk.reshape(B * T, k)).reshape(B, T, D)

    sizes = jnp.full((E,), B * T * k // E, jnp.int32)
    x_MD = jnp.tile(x.reshape(B * T, D), (k, 1))
    b = grouped.block_rows(B * T * k, E)
    n = -(-(B * T * k + E * (b - 1)) // b)
    x_nbD = normal(n, b, D, dtype=dt, scale=1.0)
    w_n = (normal(n, D, F), normal(n, D, F), normal(n, F, D))

    def bmm(x_nbD, g, u, d):
        h = act(project("nbd,ndf->nbf", x_nbD, g)) * project("nbd,ndf->nbf", x_nbD, u)
        return project("nbf,nfd->nbd", h, d)

    def moe_layer(x, router, gate, up, down):
        r, aux = routing(x, router)
        y, _ = moe_parallel.experts("blocked", x, r, 0, gate, up, down, glu)  # no mesh: this device's tokens
        return y, aux

    pieces = {
        "dense_mlp_2F": (dense_mlp, (x, normal(D, 2 * F), normal(D, 2 * F), normal(2 * F, D))),
        "moe_layer_blocked": (moe_layer, (x, router, gate, up, down)),
        "routing_and_aux_loss": (route_only, (x, router)),
        "routing_sort_and_unsort": (sort_only, (x, router)),
        "blocked_expert_mlp": (lambda x, g, u, d: grouped.ffn("blocked", x, sizes, g, u, d, glu), (x_MD, gate, up, down)),
        f"batched_matmuls_only_{n}x{b}_rows": (bmm, (x_nbD, *w_n)),
        # the same products unbatched: what the blocks' rows cost as one matmul each (not an MoE)
        f"unbatched_matmuls_{n * b}_rows": (lambda x, g, u, d: bmm(x[None], g[None], u[None], d[None]),
                                            (x_nbD.reshape(n * b, D), *(w[0] for w in w_n))),
        # the formulations tried against `blocked` (the same results): XLA's grouped matmul, and
        # blocked at other block sizes (worst-case padding G·(b − 1) rows)
        "expert_mlp_ragged_dot": (lambda x, g, u, d: grouped.ffn("ragged", x, sizes, g, u, d, glu), (x_MD, gate, up, down)),
        **{f"blocked_expert_mlp_b{rows}": (
            lambda x, g, u, d, rows=rows: _with_block(rows, grouped.ffn, "blocked", x, sizes, g, u, d, glu),
            (x_MD, gate, up, down)) for rows in (64, 256)},
    }
    fns = {}
    for name, (f, args) in pieces.items():
        def loss(*a, f=f):
            y = f(*a)
            y, aux = y if isinstance(y, tuple) else (y, 0.0)
            return jnp.sum(jnp.square(y.astype(f32))) + aux
        compiled = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
        jax.block_until_ready(compiled(*args))
        fns[name] = lambda compiled=compiled, args=args: compiled(*args)
    return fns


def _with_block(rows: int, f, *args):
    """f(*args) traced with `blocked`'s block size set to `rows` (grouped.block_rows's choice otherwise)."""
    from maxlite.models import grouped

    chosen = grouped.block_rows
    grouped.block_rows = lambda M, G: rows
    try:
        return f(*args)
    finally:
        grouped.block_rows = chosen


def _summary(times: dict, base: str) -> dict:
    import numpy as np

    med = {n: {k: float(np.median(v)) for k, v in t.items()} for n, t in times.items()}
    return {n: {"median_cpu_s": med[n]["cpu_s"], "median_wall_s": med[n]["wall_s"],
                "cpu_ratio_to_" + base: med[n]["cpu_s"] / med[base]["cpu_s"],
                "wall_ratio_to_" + base: med[n]["wall_s"] / med[base]["wall_s"], **times[n]} for n in times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="train steps per repeat and variant")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_tiny-moe_vs_tiny_interleaved.json"))
    args = parser.parse_args()
    import jax

    load_before = _load()
    fns, chosen = step_fns()
    from maxlite.models import matmul
    cpu_matmul_path = matmul._cpu_path[0]  # what `auto` chose (the builds set it); the layers run on it too
    steps = _summary(_interleaved(fns, args.repeats, args.steps), "tiny")
    layers = _summary(_interleaved(layer_fns(), args.repeats, 3), "dense_mlp_2F")
    write_result({
        "command": "JAX_PLATFORMS=cpu python benchmarks/bench_moe_cpu.py " + " ".join(sys.argv[1:]),
        "step_config": STEP, "moe_implementation": chosen, "repeats": args.repeats,
        "steps_per_repeat": args.steps, "jax": jax.__version__, "cpus": os.cpu_count(),
        "load_before": load_before, "load_after": _load(), "cpu_flags": _cpu_flags(),
        "cpu_matmul": cpu_matmul_path,
        "step": steps, "layer_forward_backward": layers,
    }, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
