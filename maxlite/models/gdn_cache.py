"""The gated delta-net's decode cache (the `gated_deltanet` mixer kind's; maxlite/models/decode.py
drives it for every layer of the kind): each layer's recurrent state [M, E, U] in float32 and the
last W−1 inputs of its convolution — a fixed number of bytes per layer and sequence, whatever the
context length.

The prefill and every decode step run the layer's own chunked form from the cache (empty at the
prefill: what training computes); right-padded rows' padding neither writes the state (β = 0,
g = 0) nor the convolution window (the window is the last W−1 real inputs). A decode step of one
token runs chunks of one: the recurrent form. Shape legend as in gated_deltanet.py, L the layers
of the kind.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlite.models.layers import constrain

STATE_AXES = ("layers", "activation_batch", "activation_heads", None, None)
BATCH_AXES = (1, 0)  # of (every state leaf [L, B, ...], the shared part: none), as gqa_cache.BATCH_AXES


class State(NamedTuple):
    conv_q: jax.Array   # [L, B, W−1, J, E] the convolution's last inputs, per filtered tensor
    conv_k: jax.Array   # [L, B, W−1, J, E]
    conv_v: jax.Array   # [L, B, W−1, M, U]
    S: jax.Array        # [L, B, M, E, U] float32


def empty(cfg, variant: str, layers: int, batch: int, length: int) -> tuple[State, tuple]:
    """(every layer's empty state, nothing shared between the layers)."""
    J, M, E, U = cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim
    V, dt = cfg.gdn_conv_kernel_dim - 1, jnp.dtype(cfg.dtype)
    S = constrain(jnp.zeros((layers, batch, M, E, U), jnp.float32), STATE_AXES)
    return State(jnp.zeros((layers, batch, V, J, E), dt), jnp.zeros((layers, batch, V, J, E), dt),
                 jnp.zeros((layers, batch, V, M, U), dt), S), ()


def step(mixer, x_BTD, positions_BT, lengths_B, state: State, shared, variant: str, prefill_cfg=None, rope_BT=None):
    """One layer over T new tokens from its cache: (the mixer's output x_BTD, the new state). The
    recurrence reads no positions: a multimodal prompt's RoPE positions (`rope_BT`) pass it by."""
    valid_BT = positions_BT < lengths_B[:, None]
    seg_BT = jnp.ones(positions_BT.shape, jnp.int32)  # one sequence per row: the state continues it
    chunk = min(mixer.cfg.gdn_chunk_size, x_BTD.shape[1])
    out_BTD, (cq, ck, cv), S = mixer.mix(x_BTD, seg_BT, valid_BT, (state.conv_q, state.conv_k, state.conv_v),
                                         state.S, chunk)
    return out_BTD, State(cq.astype(state.conv_q.dtype), ck.astype(state.conv_k.dtype),
                          cv.astype(state.conv_v.dtype), constrain(S, STATE_AXES[1:]))


def advance(shared, positions_BT, lengths_B):
    return shared
