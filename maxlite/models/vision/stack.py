"""A vision tower's layers as one stack [L, ...] and the scan that runs it (siglip.py, gemma4_vit.py).

The stack's layer dim is unsharded: the decoder's `layers` name would split it over pipeline stages,
which a tower is not part of.
"""

from __future__ import annotations

from typing import Callable

from flax import nnx


def layer_stack(depth: int, make: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
    """`depth` layers made by `make(rngs)`, each with its own random numbers, stacked on a leading axis."""
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def build(rngs):
        return make(rngs)
    return build(rngs)


def run_stack(layers: nnx.Module, x, *args):
    """`x` through every layer of the stack in order; `args` are the same for each layer."""
    @nnx.scan(in_axes=(nnx.Carry, 0, *(None,) * len(args)), out_axes=nnx.Carry,
              transform_metadata={nnx.PARTITION_NAME: None})
    def step(x, layer, *rest):
        return layer(x, *rest)
    return step(x, layers, *args)
