"""maxlite/models/grouped.py's `blocked`: its two forms (a window per group when every group fits
one, else blocks of b rows) each equal a per-row loop, values and gradients, with the experts' biases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlite.models import grouped

M, D, F, G = 48, 8, 4, 4  # a balanced group: 12 rows, a window 16


def _glu(g, u):
    return jax.nn.silu(g) * u


def _per_row(x_MD, sizes_G, gate, up, down, gate_bias, up_bias):
    """Row r of group g: down_g(glu(x_r gate_g + gate_bias_g, x_r up_g + up_bias_g)), each row with its
    own copy of its group's weights; rows past the groups: 0."""
    group_M = np.repeat(np.arange(G), sizes_G)
    n = len(group_M)
    x = x_MD[:n]
    h = _glu(jnp.einsum("md,mdf->mf", x, gate[group_M]) + gate_bias[group_M],
             jnp.einsum("md,mdf->mf", x, up[group_M]) + up_bias[group_M])
    return jnp.concatenate([jnp.einsum("mf,mfd->md", h, down[group_M]), jnp.zeros((M - n, D))])


@pytest.mark.parametrize("sizes", [[12, 9, 14, 11], [30, 0, 16, 2]], ids=["windows", "blocks"])
def test_blocked_equals_a_per_row_loop(sizes):
    W = grouped.window_rows(M, G)
    assert (max(sizes) <= W) == (sizes[0] == 12)  # the first case fits the windows, the second does not
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.normal(0, 1, s).astype(np.float32))
            for s in ((M, D), (G, D, F), (G, D, F), (G, F, D), (G, F), (G, F))]
    sizes_G = jnp.asarray(sizes, jnp.int32)
    cotangent = jnp.asarray(rng.normal(0, 1, (M, D)).astype(np.float32))

    def blocked(x, gate, up, down, gb, ub):
        return grouped.ffn("blocked", x, sizes_G, gate, up, down, _glu, gb, ub)

    def reference(*a):
        return _per_row(a[0], sizes, *a[1:])

    ours, ref = (jax.jit(jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a) * cotangent), argnums=tuple(range(6))))(*args)
                 for f in (blocked, reference))
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    for got, want, name in zip(ours[1], ref[1], ("x", "gate", "up", "down", "gate_bias", "up_bias")):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
