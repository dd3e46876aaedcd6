"""The model's matmuls: operands in the compute dtype, accumulated in float32, result rounded back.

`project("btd,df->btf", x, w)` is what a bf16 einsum means on TPU and GPU, whose matrix units
accumulate in f32 and round the result: there it is `jnp.einsum`. XLA on CPU instead upcasts a
bf16 → bf16 dot to f32 × f32, half the speed of its native bf16 kernels plus the converts, so on
CPU the same product is spelled bf16 × bf16 → f32 (`preferred_element_type`) and rounded, in the
forward pass and in both backward matmuls (a custom VJP keeps the cotangents in the operands'
dtype). On TPU the explicit f32 result would cost HBM traffic the fused bf16 dot does not.

`w` may be the stored parameter (float32): it is cast to x's dtype for the product, and on CPU its
gradient comes back in float32 as accumulated, never rounded to bf16 on the way (a bf16 round of a
batch-summed gradient would make data-parallel layouts differ by an ulp).

With `quantization` set (maxlite/quant.py), a weight projection of the decoder layers runs through
Qwix's quantized dot instead, forward and backward, on every platform; the output head (the
vocabulary, V in the shape legend) and attention's batched products stay as above.

The CPU custom VJP hides its dot from `jax.checkpoint`'s dot policies, which look for `dot_general`
itself: under `remat_policy=minimal` or `save_dots` a CPU backward pass recomputed every matmul, as
`full` does. Qwix's dot they do see, but what they would keep of it is the int8 product's int32
accumulator, twice the bytes of the scaled bf16 result. So `project` names those results (a weight
matmul, or a batched one such as attention's), and `dots_saveable` / `dots_with_no_batch_dims_saveable`
below are JAX's policies plus those names: the same choice on every platform, quantized or not.

Which CPU product runs is the machine's (`cpu_matmul`, chosen by `maxlite.cpu_matmul`): "bf16", the
native bf16 × bf16 → f32 dot above, fast on CPUs with bf16 matrix instructions; or "f32", the same
operands upcast to float32 for an f32 × f32 dot, which wins where XLA only emulates bf16 (AVX2 + FMA).
Both compute each product exactly (a bf16 × bf16 product fits in f32) and accumulate in f32: they
differ only in summation order, so the rounded results agree to an ulp of the compute dtype. The
choice is one per process, like the platform itself, set by the wiring (`maxlite.build`) before
anything traces; the resolved config that carries it is part of every model's jit cache key.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxlite import quant
from maxlite.models.platform import target_platform

_WEIGHT, _BATCHED = "weight_matmul", "batched_matmul"  # the names of results a custom VJP computes
_VOCAB = "v"  # the output head's index (layers.py's legend): never quantized
_cp = jax.checkpoint_policies
# JAX's dot policies, seeing the named matmuls too (a projection's result is saved, not recomputed)
dots_saveable = _cp.save_from_both_policies(_cp.dots_saveable,
                                            _cp.save_only_these_names(_WEIGHT, _BATCHED))
dots_with_no_batch_dims_saveable = _cp.save_from_both_policies(_cp.dots_with_no_batch_dims_saveable,
                                                               _cp.save_only_these_names(_WEIGHT))


quantization = quant.using  # `with quantization(cfg.quantization):` around a model's layers

CPU_PATHS = ("bf16", "f32")  # what `cpu_matmul` resolves to (maxlite/cpu_matmul.py)
_cpu_path = ["bf16"]  # this process's CPU product: set by the wiring, read while tracing


def use_cpu_path(path: str) -> None:
    """Trace CPU matmuls as `path` (one of CPU_PATHS) from now on in this process."""
    assert path in CPU_PATHS, path
    _cpu_path[0] = path


@contextlib.contextmanager
def cpu_path(path: str):
    """`use_cpu_path(path)` for a block (the probe that times both, tests), then the previous one."""
    before = _cpu_path[0]
    use_cpu_path(path)
    try:
        yield
    finally:
        _cpu_path[0] = before


def project(spec: str, x, w):
    """einsum(spec, x, w) in x's dtype (w cast to it), accumulated in float32 on every platform;
    quantized when the mode being traced (`quantization` above) covers it."""
    if quant.active() and not _batched(spec) and _VOCAB not in spec.split("->")[1]:
        return checkpoint_name(quant.einsum(spec, x, w.astype(x.dtype)), _WEIGHT)
    if target_platform() == "cpu":
        return checkpoint_name(_accumulated(spec, x, w), _BATCHED if _batched(spec) else _WEIGHT)
    return jnp.einsum(spec, x, w.astype(x.dtype))


def _batched(spec: str) -> bool:
    """Whether the product has batch dimensions (an index of both operands and of the result)."""
    ins, out = spec.split("->")
    a, b = ins.split(",")
    return bool(set(a) & set(b) & set(out))


def _dot(spec: str, a, b, dtype):
    if _cpu_path[0] == "f32":  # exact products either way; XLA's f32 kernels where bf16 is emulated
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _accumulated(spec: str, x, w):
    return _dot(spec, x, w.astype(x.dtype), x.dtype)


def _fwd(spec, x, w):
    return _accumulated(spec, x, w), (x, w)


def _bwd(spec, res, g):
    x, w = res
    ins, out = spec.split("->")
    a, b = ins.split(",")
    g = g.astype(x.dtype)
    dx = _dot(f"{out},{b}->{a}", g, w.astype(x.dtype), x.dtype)
    dw = _dot(f"{a},{out}->{b}", x, g, w.dtype)  # in w's own dtype: f32 for a stored parameter
    return dx, dw


_accumulated.defvjp(_fwd, _bwd)
