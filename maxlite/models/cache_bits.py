"""How a decode cache that is written in place holds 16-bit floats on a CPU: as their bits (uint16).

XLA:CPU has no bfloat16 scatter or dynamic-update-slice of its own: it converts the whole operand to
float32, updates that, and converts it back. A decode step writes each layer's new keys into the stack
of every layer's cache that the loop carries, so each layer's write cost four passes over the whole
stack (llama-100m, 32 slots × 304 positions: 80% of a rollout step, 641 of 804 ms). The same bits
held as uint16 are written where they lie, and a read views the slice it cuts out as the compute dtype
again (free: the view fuses into the read's copy). Other platforms, and 32-bit caches, hold the values
as they are. What is stored is the same bits either way: the cache's bytes, sizes and results are
unchanged. The rollout engine holds its copy of the layer weights the same way
(maxlite/rollout/weights.py): a layer views them as the compute dtype before it runs (`viewed`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models.platform import target_platform


def stored(dtype) -> jnp.dtype:
    """The dtype a cache of `dtype` values is held in, for the program being traced."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) and target_platform() == "cpu":
        return jnp.dtype(jnp.uint16)
    return dtype


def store(x, held_dtype, dtype):
    """`x` as an array held in `held_dtype` keeps it: values as the bits of `dtype` (the 16-bit float
    the cache keeps) where it holds bits and `x` is not bits already, else cast to `held_dtype` (what a
    plain write into it does)."""
    if jnp.dtype(held_dtype) == jnp.uint16 and x.dtype != jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint16)
    return x.astype(held_dtype)


def load(a, dtype):
    """What a held array (or a slice of one) stores, as `dtype`."""
    return jax.lax.bitcast_convert_type(a, dtype) if a.dtype == jnp.uint16 else a


def viewed(module, dtype):
    """`module` with the arrays it holds as bits (uint16: the rollout engine's held weights) read as
    `dtype`; itself where it holds none."""
    graphdef, state = nnx.split(module)
    if not any(x.dtype == jnp.uint16 for x in jax.tree.leaves(state)):
        return module
    return nnx.merge(graphdef, jax.tree.map(lambda a: load(a, dtype), state))
