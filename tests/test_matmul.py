"""The model's projections: einsum's values and gradients; on CPU every matmul bf16 × bf16 → f32."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import dot_equations
from maxlite.models.matmul import CPU_PATHS, cpu_path, project

SPECS = {  # the model's projections: MLP, query/key/value, output, head; and attention's two
    "btd,df->btf": ((2, 8, 16), (16, 24)),
    "btd,dnh->btnh": ((2, 8, 16), (16, 4, 8)),
    "btnh,nhd->btd": ((2, 8, 4, 8), (4, 8, 16)),
    "btkgh,bskh->bkgts": ((2, 8, 2, 2, 8), (2, 8, 2, 8)),
}


def _operands(spec, dtype, seed=0):
    x_shape, w_shape = SPECS[spec]
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x, w = jax.random.normal(kx, x_shape, dtype), jax.random.normal(kw, w_shape, dtype)
    g = jax.random.normal(kg, jnp.einsum(spec, x, w).shape, dtype)  # a cotangent
    return x, w, g


def _value_and_grads(fn, x, w, g):
    out, vjp = jax.vjp(fn, x, w)
    return out, vjp(g)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_project_equals_einsum_in_float32(spec):
    x, w, g = _operands(spec, jnp.float32)
    out, (dx, dw) = _value_and_grads(lambda x, w: project(spec, x, w), x, w, g)
    ref, (rdx, rdw) = _value_and_grads(lambda x, w: jnp.einsum(spec, x, w), x, w, g)
    for got, want in ((out, ref), (dx, rdx), (dw, rdw)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_bfloat16_project_is_close_to_float32_and_returns_bfloat16(spec):
    x, w, g = _operands(spec, jnp.bfloat16)
    out, (dx, dw) = _value_and_grads(lambda x, w: project(spec, x, w), x, w, g)
    f32 = [a.astype(jnp.float32) for a in (x, w, g)]
    ref, (rdx, rdw) = _value_and_grads(lambda x, w: jnp.einsum(spec, x, w), *f32)
    for got, want in ((out, ref), (dx, rdx), (dw, rdw)):
        assert got.dtype == jnp.bfloat16
        # one bf16 rounding of an f32-accumulated sum (8 bits of mantissa)
        np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=1e-2, atol=2e-2)


def test_a_stored_float32_weight_gets_its_gradient_in_float32_unrounded():
    """The parameter (f32) is cast for the product; its gradient, a sum over every token of the batch,
    comes back as accumulated: rounding it to bf16 would let two data-parallel layouts of the same
    batch differ by an ulp of bf16 (a two-worker run no longer matched one process)."""
    spec = "btd,df->btf"
    x, w, g = _operands(spec, jnp.bfloat16)
    w32 = w.astype(jnp.float32) * 1.001  # not representable in bf16
    _, (dx, dw) = _value_and_grads(lambda x, w: project(spec, x, w), x, w32, g)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    want = jnp.einsum("btd,btf->df", x.astype(jnp.float32), g.astype(jnp.float32))
    np.testing.assert_allclose(dw, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path, operand", [("bf16", jnp.bfloat16), ("f32", jnp.float32)])
def test_every_matmul_forward_and_backward_is_accumulated_in_float32_on_the_cpu_path(path, operand):
    """What XLA is handed: an f32 result, in the forward pass and both backward matmuls, with bf16
    operands on the bf16 path (CPU runs its native bf16 kernels on such a dot; a bf16 → bf16 dot it
    upcasts to f32 × f32) and the upcast f32 operands on the f32 path."""
    spec = "btd,df->btf"
    x, w, g = _operands(spec, jnp.bfloat16)
    w = w.astype(jnp.float32)  # as stored: cast at use
    with cpu_path(path):
        jaxpr = jax.make_jaxpr(lambda x, w, g: _value_and_grads(lambda x, w: project(spec, x, w), x, w, g))(x, w, g)
    dots = list(dot_equations(jaxpr.jaxpr))
    assert len(dots) == 3  # forward, dx, dw
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [operand, operand], eqn
        assert eqn.outvars[0].aval.dtype == jnp.float32, eqn


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_both_cpu_paths_give_the_same_rounded_products(spec):
    """Both paths form each bf16 × bf16 product exactly in f32 and sum in f32, in different orders;
    so their bf16 results differ by at most one rounding step (an ulp of bf16, 2^-8 relative) plus
    twice a float32 summation's error bound (n · 2^-24 · Σ|a·b| for n terms), in value and gradients."""
    x, w, g = _operands(spec, jnp.bfloat16)
    results = {}
    for path in CPU_PATHS:
        with cpu_path(path):
            results[path] = jax.jit(lambda x, w, g: _value_and_grads(lambda x, w: project(spec, x, w), x, w, g))(x, w, g)
    ins, out = spec.split("->")
    a, b = ins.split(",")
    terms = {"out": (f"{a},{b}->{out}", x, w), "dx": (f"{out},{b}->{a}", g, w), "dw": (f"{a},{out}->{b}", x, g)}
    (bf_out, (bf_dx, bf_dw)), (f_out, (f_dx, f_dw)) = results["bf16"], results["f32"]
    for name, bf, f in (("out", bf_out, f_out), ("dx", bf_dx, f_dx), ("dw", bf_dw, f_dw)):
        assert bf.dtype == f.dtype == jnp.bfloat16, name
        sub, p, q = terms[name]
        (pa, qa), res = [t.split(",") for t in sub.split("->")[0:1]][0], sub.split("->")[1]
        sizes = dict(zip(pa + qa, p.shape + q.shape))
        n = np.prod([sizes[c] for c in set(pa + qa) - set(res)])  # terms in each sum
        abs_sum = np.asarray(jnp.einsum(sub, jnp.abs(p.astype(jnp.float32)), jnp.abs(q.astype(jnp.float32))))
        bf, f = np.asarray(bf, np.float32), np.asarray(f, np.float32)
        bound = np.maximum(np.abs(bf), np.abs(f)) * 2.0**-8 + 2 * n * 2.0**-24 * abs_sum
        assert np.all(np.abs(bf - f) <= bound), (name, np.max(np.abs(bf - f) - bound))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs the tpu extra")
def test_on_tpu_a_projection_is_the_plain_bfloat16_dot_the_matrix_unit_fuses():
    """Traced for a TPU topology (the planner's path), the same call is einsum's bf16 → bf16 dot: an
    explicit f32 result there would add HBM traffic (the planner saw the 8B step turn memory-bound)."""
    from jax.sharding import Mesh

    from maxlite.plan import topology as T

    spec = "btd,df->btf"
    x, w, g = _operands(spec, jnp.bfloat16)
    mesh = Mesh(np.array(T.devices(T.parse("v6e:2x2"))), ("data",))
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda x, w, g: _value_and_grads(lambda x, w: project(spec, x, w), x, w, g))(x, w, g)
    dots = list(dot_equations(jaxpr.jaxpr))
    assert len(dots) == 3 and all(eqn.outvars[0].aval.dtype == jnp.bfloat16 for eqn in dots), dots
