"""The mixture of experts' implementations on one device's tokens (maxlite/models/moe.py routes,
maxlite/models/moe_parallel.py runs these per shard and exchanges tokens between expert shards):
`dense`, the sort by expert the grouped implementations share, and the capacity buffers.

Every implementation computes an expert's hidden as glu(x·gate + gate_bias, x·up + up_bias): `glu`
is the family's (silu(g)·u for SwiGLU; gpt-oss's clamped form), the biases (gpt-oss's mlp_bias)
optional; the down projection's bias is added by moe.py after the combine.

Shape legend as in moe.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxlite.models.matmul import project


class Routing(NamedTuple):
    experts_BTk: jax.Array  # int32: each token's experts, best first
    weights_BTk: jax.Array  # float32: their weights, 0 where dropped
    kept_BTk: jax.Array     # bool: the assignment is computed (dropped ones are not)
    slots_BTk: jax.Array    # int32: its slot in the expert's capacity buffer (capacity routing; else 0)
    stats: dict             # per layer: tokens [], routed [E], probs [E], dropped [], z []


def combine(y_XkD, weights_Xk):
    """Σ_j weight_j · y_j in float32."""
    return jnp.einsum("xkd,xk->xd", y_XkD.astype(jnp.float32), weights_Xk)


def with_bias(h_E_F, bias_EF):
    """h [E, ..., F] + each expert's bias [E, F] (None: h)."""
    if bias_EF is None:
        return h_E_F
    return h_E_F + bias_EF.astype(h_E_F.dtype).reshape(bias_EF.shape[0], *(1,) * (h_E_F.ndim - 2), -1)


def dense(x_BTD, routing: Routing, gate_EDF, up_EDF, down_EFD, glu, gate_bias_EF=None, up_bias_EF=None):
    """Every expert on every token; the routing's weights (0 for the rest) combine them."""
    E = gate_EDF.shape[0]
    combine_BTE = jnp.sum(jax.nn.one_hot(routing.experts_BTk, E, dtype=jnp.float32)
                          * routing.weights_BTk[..., None], axis=2)
    h_EBTF = glu(with_bias(project("btd,edf->ebtf", x_BTD, gate_EDF), gate_bias_EF),
                 with_bias(project("btd,edf->ebtf", x_BTD, up_EDF), up_bias_EF))
    y_EBTD = project("ebtf,efd->ebtd", h_EBTF, down_EFD)
    return jnp.einsum("ebtd,bte->btd", y_EBTD.astype(jnp.float32), combine_BTE)


def sort_by_expert(experts_Xk, E: int):
    """(the assignments' order sorted by expert (stable), each expert's count [E])."""
    flat_M = experts_Xk.reshape(-1)
    return jnp.argsort(flat_M, stable=True), jnp.bincount(flat_M, length=E).astype(jnp.int32)


def unsort(y_MD, order_M, k: int):
    """Sorted rows back in assignment order [X, k, D] (a gather by the inverse permutation)."""
    return jnp.take(y_MD, jnp.argsort(order_M), axis=0).reshape(-1, k, y_MD.shape[-1])


def capacity_buffers(x_BTD, routing: Routing, E: int, C: int):
    """[B, E, C, D]: each expert's token slots of every sequence (empty slots zero)."""
    B, T, D = x_BTD.shape
    flat_BM = _flat_slots(routing, C, E).reshape(B, -1)
    tokens_BM = jnp.broadcast_to(jnp.arange(T)[:, None], routing.experts_BTk.shape).reshape(B, -1)
    table_BS = jax.vmap(lambda f, t: jnp.full((E * C + 1,), T).at[f].set(t))(flat_BM, tokens_BM)[:, :-1]
    x_pad = jnp.concatenate([x_BTD, jnp.zeros((B, 1, D), x_BTD.dtype)], axis=1)
    return jnp.take_along_axis(x_pad, table_BS[..., None], axis=1).reshape(B, E, C, D)


def _flat_slots(routing: Routing, C: int, E: int):
    """Each assignment's index in the flattened [E·C] buffer; E·C (one past) when dropped."""
    return jnp.where(routing.kept_BTk, routing.experts_BTk * C + routing.slots_BTk, E * C)


def capacity_ffn(buf_GECD, gate_EDF, up_EDF, down_EFD, glu, gate_bias_EF=None, up_bias_EF=None):
    """The experts on their buffers [G, E, C, D] (G groups of sequences), batched over experts."""
    G, E, C, D = buf_GECD.shape
    x_EMD = jnp.swapaxes(buf_GECD, 0, 1).reshape(E, G * C, D)
    h_EMF = glu(with_bias(project("emd,edf->emf", x_EMD, gate_EDF), gate_bias_EF),
                with_bias(project("emd,edf->emf", x_EMD, up_EDF), up_bias_EF))
    y_EMD = project("emf,efd->emd", h_EMF, down_EFD)
    return jnp.swapaxes(y_EMD.reshape(E, G, C, D), 0, 1)


def capacity_combine(y_BECD, routing: Routing):
    """Each token's kept slots, weighted ([B, T, D] float32)."""
    B, E, C, D = y_BECD.shape
    T, k = routing.experts_BTk.shape[1:]
    y_pad = jnp.concatenate([y_BECD.reshape(B, E * C, D), jnp.zeros((B, 1, D), y_BECD.dtype)], axis=1)
    flat_BM = _flat_slots(routing, C, E).reshape(B, T * k)
    y_BMD = jnp.take_along_axis(y_pad, flat_BM[..., None], axis=1)
    return combine(y_BMD.reshape(B * T, k, D), routing.weights_BTk.reshape(B * T, k)).reshape(B, T, D)
