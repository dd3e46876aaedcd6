"""The `none` kinds: a layer without a mixer or without a feed-forward (Nemotron-H's blocks are one
or the other). Each adds nothing to the residual, has no parameters, no norm before it (the kind
reads the raw input: kinds.py `raw_input`), no FLOPs, and the mixer no decode cache — this module is
its cache module too (`empty`, `step`, `advance`, BATCH_AXES as the others')."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

BATCH_AXES = (1, 0)


class NoMixer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        pass

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False):
        return jnp.zeros_like(x_BTD)


class NoFeedForward(nnx.Module):
    def __call__(self, x_BTD, dropout_key=None):
        return jnp.zeros_like(x_BTD)


def no_feed_forward(cfg, *, rngs: nnx.Rngs) -> NoFeedForward:
    return NoFeedForward()


def empty(cfg, variant: str, layers: int, batch: int, length: int) -> tuple[tuple, tuple]:
    return (), ()


def step(mixer, x_BTD, positions_BT, lengths_B, state, shared, variant: str, prefill_cfg=None):
    return jnp.zeros_like(x_BTD), state


def advance(shared, positions_BT, lengths_B):
    return shared
