"""The Mamba-2 mixer's decode cache (the `mamba2` mixer kind's; maxlite/models/decode.py drives it for
every layer of the kind): each layer's state [M, P, S] in float32 and the last W−1 inputs of its
convolution — a fixed number of bytes per layer and sequence, whatever the context length.

The prefill and every decode step run the layer's own chunked form from the cache (empty at the
prefill: what training computes); right-padded rows' padding neither writes the state (Δ = 0) nor
the convolution window (the window is the last W−1 real inputs). A decode step of one token runs
chunks of one: the recurrent form. Shape legend as in mamba2.py, L the layers of the kind.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlite.models.layers import constrain

STATE_AXES = ("layers", "activation_batch", "activation_heads", None, None)
BATCH_AXES = (1, 0)  # of (every state leaf [L, B, ...], the shared part: none), as gqa_cache.BATCH_AXES


class State(NamedTuple):
    conv_x: jax.Array   # [L, B, W−1, M, P] the convolution's last inputs, per filtered tensor
    conv_B: jax.Array   # [L, B, W−1, G, S]
    conv_C: jax.Array   # [L, B, W−1, G, S]
    h: jax.Array        # [L, B, M, P, S] float32


def empty(cfg, variant: str, layers: int, batch: int, length: int) -> tuple[State, tuple]:
    """(every layer's empty state, nothing shared between the layers)."""
    M, P, G, S = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_num_groups, cfg.mamba_state_dim
    V, dt = cfg.mamba_conv_kernel_dim - 1, jnp.dtype(cfg.dtype)
    h = constrain(jnp.zeros((layers, batch, M, P, S), jnp.float32), STATE_AXES)
    return State(jnp.zeros((layers, batch, V, M, P), dt), jnp.zeros((layers, batch, V, G, S), dt),
                 jnp.zeros((layers, batch, V, G, S), dt), h), ()


def step(mixer, x_BTD, positions_BT, lengths_B, state: State, shared, variant: str, prefill_cfg=None):
    """One layer over T new tokens from its cache: (the mixer's output x_BTD, the new state)."""
    valid_BT = positions_BT < lengths_B[:, None]
    seg_BT = jnp.ones(positions_BT.shape, jnp.int32)  # one sequence per row: the state continues it
    chunk = min(mixer.cfg.mamba_chunk_size, x_BTD.shape[1])
    out_BTD, (cx, cb, cc), h = mixer.mix(x_BTD, seg_BT, valid_BT, (state.conv_x, state.conv_B, state.conv_C),
                                         state.h, chunk)
    return out_BTD, State(cx.astype(state.conv_x.dtype), cb.astype(state.conv_B.dtype),
                          cc.astype(state.conv_C.dtype), constrain(h, STATE_AXES[1:]))


def advance(shared, positions_BT, lengths_B):
    return shared
