"""Which product a CPU runs the model's bf16 matmuls with (`cpu_matmul`), chosen per machine by measurement.

XLA:CPU can multiply bf16 operands natively (bf16 × bf16 → f32), or upcast them and run its float32
kernels (`maxlite.models.matmul`). Which is faster is the CPU's: with bf16 matrix instructions
(avx512_bf16, AMX) the native dot wins; on an AVX2 + FMA CPU XLA emulates it and the float32 product
won by 1.35× per step. So `auto` times both at the model's own shapes (the forward and both
backward products of a step's projections, capped at 512 rows and 1024 elsewhere), keeps the faster,
and caches the answer per CPU model (its name and instruction flags), JAX version and shapes, in
`cpu_matmul.json` beside the compile cache: a machine measures once (the MFU's measured peak,
maxlite/peak.py, is cached there too). `bf16` / `f32` force a path.
With `dtype=float32` there is nothing to choose.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import Callable

PATHS = ("bf16", "f32")


@dataclasses.dataclass(frozen=True)
class Choice:
    path: str  # what runs: bf16 | f32
    how: str  # forced | measured | cached | float32 model
    seconds: dict  # path → best time of the probe (measured or cached; empty otherwise)

    def describe(self) -> str:
        times = ", ".join(f"{p} {s * 1e3:.2f} ms" for p, s in sorted(self.seconds.items()))
        return f"{self.path} ({self.how}{': ' + times if times else ''})"

    def record(self) -> dict:
        """What status.json keeps."""
        return {"path": self.path, "how": self.how, **({"seconds": self.seconds} if self.seconds else {})}


def faster(seconds: dict) -> str:
    """The path with the shorter time (bf16 on a tie: no converts)."""
    return min(PATHS, key=lambda p: seconds[p])


def choose(cfg, time_paths: Callable[[object], dict] | None = None) -> Choice:
    """`cfg.cpu_matmul` for this CPU: forced, cached, or measured by `time_paths(cfg)` (default
    `probe`) and cached beside cfg.jax_cache_dir (not when it is off)."""
    if cfg.dtype == "float32":
        return Choice("f32", "float32 model", {})
    if cfg.cpu_matmul != "auto":
        return Choice(cfg.cpu_matmul, "forced", {})
    cache_file = default_cache_file(cfg)
    key = f"{cpu_identity()} | jax {_jax_version()} | {_shapes(cfg)}"
    cached = read_entries(cache_file).get(key)
    if cached:
        return Choice(cached["path"], "cached", cached["seconds"])
    seconds = (time_paths or probe)(cfg)
    choice = Choice(faster(seconds), "measured", seconds)
    if cache_file:
        write_entry(cache_file, key, {"path": choice.path, "seconds": seconds})
    return choice


def default_cache_file(cfg) -> str:
    """cpu_matmul.json beside the compile cache (~/.cache/maxlite/); "" when there is none on local disk."""
    if not cfg.jax_cache_dir or "://" in cfg.jax_cache_dir:
        return ""
    return os.path.join(os.path.dirname(cfg.jax_cache_dir.rstrip("/")), "cpu_matmul.json")


def cpu_identity() -> str:
    """The CPU model: /proc/cpuinfo's model name and a hash of its flags (what XLA's kernels use)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:  # not Linux
        import platform
        model = platform.processor() or platform.machine()
    return f"{model} [flags {hashlib.sha256(flags.encode()).hexdigest()[:12]}]"


def _jax_version() -> str:
    import jax
    return jax.__version__


# The probe's dimensions are capped: a big model's products run the same kernels at a fraction of
# the cost (uncapped, llama-100m's head alone was seconds per timing on 2 cores, and a 405B recipe
# would probe for minutes before the check that it cannot fit): ≤ 10 GFLOP a timing.
_MAX_ROWS, _MAX_DIM = 512, 1024


def _tokens(cfg) -> int:
    """Rows of the probe: one device's micro-batch of tokens (at least one sequence), capped."""
    return min(_MAX_ROWS, max(1, round(cfg.per_device_batch_size)) * cfg.max_target_length)


def _widths(cfg) -> tuple[int, ...]:
    """Columns of the probe's products: the MLP's, attention's (heads × head dim), the vocabulary's."""
    return tuple(min(_MAX_DIM, n) for n in
                 (cfg.base_mlp_dim, cfg.base_num_query_heads * cfg.head_dim, cfg.vocab_size))


def _model_dim(cfg) -> int:
    return min(_MAX_DIM, cfg.base_emb_dim)


def _shapes(cfg) -> str:
    """The probe's shapes (part of the cache key): rows, model dim, columns."""
    return f"M{_tokens(cfg)} D{_model_dim(cfg)} N{'/'.join(map(str, _widths(cfg)))}"


def probe(cfg, repeats: int = 5) -> dict:
    """Best time of each path over `repeats` interleaved runs of a step's projections at the model's
    shapes (capped above): x [tokens, D] × w [D, F], [D, heads × head_dim] and [D, V], forward and
    both backward products, through `project` itself."""
    import jax
    import jax.numpy as jnp

    from maxlite.models import matmul

    dt = jnp.dtype(cfg.dtype)
    widths = _widths(cfg)
    keys = jax.random.split(jax.random.key(0), len(widths) + 1)
    D = _model_dim(cfg)
    x = jax.random.normal(keys[0], (_tokens(cfg), D), dt)
    ws = [jax.random.normal(k, (D, n), jnp.float32) * 0.05 for k, n in zip(keys[1:], widths)]

    def loss(x, ws):  # a sum of squares: every product's backward has a dense cotangent
        return sum(jnp.sum(jnp.square(matmul.project("md,dn->mn", x, w).astype(jnp.float32))) for w in ws)

    programs = {}
    for path in PATHS:
        with matmul.cpu_path(path):  # traced (and so fixed) here
            programs[path] = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ws).compile()
    best = {path: float("inf") for path in PATHS}
    for _ in range(repeats):
        for path, program in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(program(x, ws))
            best[path] = min(best[path], time.perf_counter() - start)
    return best


def read_entries(cache_file: str) -> dict:
    try:
        with open(cache_file) as f:
            return json.load(f)
    except (OSError, ValueError):  # none yet, or torn by a writer killed mid-way: measure again
        return {}


def write_entry(cache_file: str, key: str, entry: dict) -> None:
    """Add one answer (atomic rename: concurrent runs lose an entry at worst, never the file)."""
    entries = read_entries(cache_file)
    entries[key] = entry
    os.makedirs(os.path.dirname(cache_file) or ".", exist_ok=True)
    tmp = f"{cache_file}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, cache_file)
