"""Where the experts run: on each device's own tokens, and with expert parallelism on the devices
that hold them, tokens sent there and back by all-to-all.

`dense` is left to the compiler (GSPMD partitions its einsums). The others run inside a shard_map
over the batch: sorting tokens by expert needs a device's own tokens, not a global sort. Its specs
come from the logical-axis rules that are active (maxlite/mesh.py), never from mesh axis names
written here: tokens split like `activation_batch`, the experts like `exp` (gathered over their
`embed_no_exp` fsdp split at the boundary, their gradient reduce-scattered back), the MLP width like
`mlp` (each device's partial output summed over it).

With the `exp` axis of size ep > 1, each device holds E/ep experts and every device's tokens go to
the devices of their experts:

  capacity   the [B, E, C, D] slot buffers all-to-all (split over E, gathered over B): each device
             gets [ep·B, E/ep, C, D], computes its experts, and the reverse all-to-all brings the
             slots home. Fixed shapes.
  ragged, blocked, megablox (dropless)
             the tokens sorted by expert are cut where the next device's experts start; on TPU and
             GPU `jax.lax.ragged_all_to_all` sends each device exactly its rows (received packed,
             source after source), on CPU (whose XLA has no ragged all-to-all) an all-to-all of
             [ep, M, D] buffers, each device's rows padded to M = its tokens × k. Either way the
             receiver regroups what came by local expert (a stable sort), runs them, and the
             reverse exchange returns the rows where they came from. Nothing is dropped: a
             receiver has room for every row of every sender (ep · M rows, as MaxText's buffer).

Shape legend as in moe.py; ep expert shards, El = E/ep local experts, R received rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from maxlite.models import grouped, moe_kernels
from maxlite.models.platform import target_platform


def buffer_rows(M: int, ep: int, factor: float) -> int:
    """Rows a device's receive buffer holds: every sender's M rows (dropless: the worst case, all
    of them for this device's experts), or with `ragged_buffer_factor` > 0 that many times a
    balanced routing's M (rounded up to 8), at most the worst case."""
    if factor <= 0:
        return ep * M
    return min(ep * M, 8 * math.ceil(factor * M / 8))


def experts(impl: str, x_BTD, routing: moe_kernels.Routing, slots: int, gate_EDF, up_EDF, down_EFD, glu,
            buffer_factor: float = -1.0, in_bias: tuple = ()):
    """(the routed experts' weighted output [B, T, D] (float32) by `impl`, the assignments the
    expert exchange dropped, all devices: 0 unless `buffer_factor` caps the receive buffers).
    `glu(gate, up)` is the family's gated hidden, `in_bias` () or the experts' (gate_bias_EF,
    up_bias_EF), split like the weights' columns."""
    none = jnp.zeros((), jnp.float32)
    if impl == "dense":
        return moe_kernels.dense(x_BTD, routing, gate_EDF, up_EDF, down_EFD, glu, *in_bias), none
    mesh = jax.sharding.get_abstract_mesh()
    local = functools.partial(_local, impl, slots, glu, buffer_factor)
    arrays = (routing.experts_BTk, routing.weights_BTk, routing.kept_BTk, routing.slots_BTk)
    if mesh.empty:
        return local(None, None, (), x_BTD, *arrays, gate_EDF, up_EDF, down_EFD, *in_bias)
    batch = nn.logical_to_mesh_axes(("activation_batch", None, None))
    w_in = nn.logical_to_mesh_axes(("exp", None, "mlp"))
    w_out = nn.logical_to_mesh_axes(("exp", "mlp", None))
    exp_axis, mlp_axis = w_in[0], w_in[2]
    assert exp_axis is None or isinstance(exp_axis, str), exp_axis  # one mesh axis (or none)
    exp_axis = exp_axis if exp_axis and mesh.shape[exp_axis] > 1 else None
    mlp_axis = mlp_axis if mlp_axis and mesh.shape[_one(mlp_axis)] > 1 else None
    token_axes = () if batch[0] is None else (batch[0],) if isinstance(batch[0], str) else tuple(batch[0])
    body = functools.partial(local, exp_axis, mlp_axis, token_axes)
    bias_spec = nn.logical_to_mesh_axes(("exp", "mlp"))
    return jax.shard_map(body, mesh=mesh, in_specs=(batch,) * 5 + (w_in, w_in, w_out) + (bias_spec,) * len(in_bias),
                         out_specs=(batch, P()), check_vma=False)(x_BTD, *arrays, gate_EDF, up_EDF, down_EFD, *in_bias)


def _one(axes):
    return axes if isinstance(axes, str) else axes[0]


def _local(impl, slots, glu, buffer_factor, exp_axis, mlp_axis, token_axes, x_BTD, experts_BTk, weights_BTk,
           kept_BTk, slots_BTk, gate_EDF, up_EDF, down_EFD, *in_bias):
    """One device's part: its tokens, its experts (all of them without an expert axis); and the
    assignments dropped by capped receive buffers, summed over the devices that split the tokens."""
    ep = 1 if exp_axis is None else jax.lax.axis_size(exp_axis)
    E = gate_EDF.shape[0] * ep
    routing = moe_kernels.Routing(experts_BTk, weights_BTk, kept_BTk, slots_BTk, {})
    dropped = jnp.zeros((), jnp.float32)

    def partial_sum(y):  # the MLP width split over `mlp`: each device holds part of the output
        return y if mlp_axis is None else jax.lax.psum(y, mlp_axis)

    if impl == "capacity":
        buf_BECD = moe_kernels.capacity_buffers(x_BTD, routing, E, slots)
        if ep > 1:
            buf_BECD = jax.lax.all_to_all(buf_BECD, exp_axis, 1, 0, tiled=True)  # [ep·B, El, C, D]
        y_BECD = partial_sum(moe_kernels.capacity_ffn(buf_BECD, gate_EDF, up_EDF, down_EFD, glu, *in_bias))
        if ep > 1:
            y_BECD = jax.lax.all_to_all(y_BECD, exp_axis, 0, 1, tiled=True)  # back: [B, E, C, D]
        return moe_kernels.capacity_combine(y_BECD, routing), dropped
    B, T, D = x_BTD.shape
    k = experts_BTk.shape[-1]
    order_M, sizes_E = moe_kernels.sort_by_expert(experts_BTk, E)
    x_MD = jnp.take(x_BTD.reshape(B * T, D), order_M // k, axis=0)
    if ep == 1:
        y_MD = partial_sum(grouped.ffn(impl, x_MD, sizes_E, gate_EDF, up_EDF, down_EFD, glu, *in_bias))
    else:
        exchange = Exchange(sizes_E, ep, exp_axis, target_platform() in ("tpu", "gpu"),
                            buffer_rows(B * T * k, ep, buffer_factor))
        x_RD, sizes_El = exchange.send(x_MD)
        y_MD = exchange.back(partial_sum(grouped.ffn(impl, x_RD, sizes_El, gate_EDF, up_EDF, down_EFD, glu, *in_bias)))
        dropped = exchange.dropped.astype(jnp.float32)
        dropped = jax.lax.psum(dropped, token_axes) if token_axes else dropped
    y_XkD = moe_kernels.unsort(y_MD, order_M, k)
    return moe_kernels.combine(y_XkD, weights_BTk.reshape(B * T, k)).reshape(B, T, D), dropped


class Exchange:
    """Rows sorted by expert sent to the devices of their experts and back (the dropless path).

    Each device's receive buffer holds R rows, the senders' rows packed source after source: R =
    every sender's rows (dropless), or fewer (`ragged_buffer_factor`), when a sender's rows past
    the buffer's end are not sent (dropped: the tail of its rows for that device, its highest
    experts' last tokens) and come back as zeros. `send(x_MD)` → (the received rows regrouped by
    local expert [R, D], their counts [El]); `back(y_RD)` takes the results in that order and
    returns my rows' [M, D], in my sorted order."""

    def __init__(self, sizes_E, ep: int, axis: str, ragged: bool, R: int):
        E = sizes_E.shape[0]
        self.ep, self.axis, self.ragged, self.El, self.R = ep, axis, ragged, E // ep, R
        self.send_sizes = jnp.sum(sizes_E.reshape(ep, self.El), axis=1)  # rows to each device [ep]
        self.send_start = jnp.cumsum(self.send_sizes) - self.send_sizes
        all_sizes = jax.lax.all_gather(sizes_E, axis)  # every device's counts [ep, E]
        self.me = me = jax.lax.axis_index(axis)
        self.shard_sizes = jnp.sum(all_sizes.reshape(ep, ep, self.El), axis=2)  # rows [source, dest]
        # where each source's rows land in each destination's buffer (after those of lower
        # sources), and how many of them fit
        land = jnp.cumsum(self.shard_sizes, axis=0) - self.shard_sizes
        fits = jnp.clip(R - land, 0, self.shard_sizes)
        self.out_offsets, self.kept_to = land[me], fits[me]  # mine at each destination [ep]
        self.recv_sizes = fits[:, me]  # what each source sends me [ep]
        self.recv_start = jnp.minimum(land[:, me], R)
        # rows each source sends me per local expert [ep, El]: the first of its sorted rows that fit
        sent = jax.lax.dynamic_slice_in_dim(all_sizes, me * self.El, self.El, axis=1)
        before = jnp.cumsum(sent, axis=1) - sent
        self.mine = jnp.clip(self.recv_sizes[:, None] - before, 0, sent)
        self.dropped = jnp.sum(self.send_sizes - self.kept_to)  # my assignments not sent

    def _regroup(self, source_N, within_N):
        """The order that puts received rows (their source and index in it) by local expert, the
        rows that are no real row last (El: past what their source sent)."""
        cum_eEl = jnp.cumsum(self.mine, axis=1)
        local_N = jax.vmap(lambda c, w: jnp.searchsorted(c, w, side="right"))(cum_eEl[source_N], within_N)
        return jnp.argsort(local_N, stable=True)

    def send(self, x_MD):
        M, D = x_MD.shape
        ep, R = self.ep, self.R
        if self.ragged:
            x_ND = jax.lax.ragged_all_to_all(x_MD, jnp.zeros((R, D), x_MD.dtype), self.send_start, self.kept_to,
                                             self.out_offsets, self.recv_sizes, axis_name=self.axis)
            source_N = jnp.clip(jnp.searchsorted(jnp.cumsum(self.recv_sizes), jnp.arange(R), side="right"), 0, ep - 1)
            within_N = jnp.arange(R) - self.recv_start[source_N]
        else:  # XLA:CPU has no ragged all-to-all: M-row buffers per destination, source-major
            self._rows_eM = self.send_start[:, None] + jnp.arange(M)
            self._ok_eM = jnp.arange(M) < self.kept_to[:, None]
            buf_eMD = jnp.where(self._ok_eM[..., None], jnp.take(x_MD, jnp.minimum(self._rows_eM, M - 1), axis=0), 0)
            x_ND = jax.lax.all_to_all(buf_eMD, self.axis, 0, 0, tiled=True).reshape(ep * M, D)
            source_N, within_N = jnp.arange(ep * M) // M, jnp.arange(ep * M) % M
        self._regroup_R = self._regroup(source_N, within_N)[:R]  # every real row is among the first R
        self._shape = (M, x_ND.shape[0], D)
        return jnp.take(x_ND, self._regroup_R, axis=0), jnp.sum(self.mine, axis=0).astype(jnp.int32)

    def back(self, y_RD):
        M, N, D = self._shape
        y_ND = jnp.zeros((N, D), y_RD.dtype).at[self._regroup_R].set(y_RD)  # back in the received order
        if self.ragged:
            # I return each source its rows: they go where that source's rows for me started
            their_offsets = jnp.sum(jnp.where(jnp.arange(self.ep)[None, :] < self.me, self.shard_sizes, 0), axis=1)
            return jax.lax.ragged_all_to_all(y_ND, jnp.zeros((M, D), y_RD.dtype), self.recv_start, self.recv_sizes,
                                             their_offsets, self.kept_to, axis_name=self.axis)
        back_eMD = jax.lax.all_to_all(y_ND.reshape(self.ep, M, D), self.axis, 0, 0, tiled=True)
        flat = jnp.where(self._ok_eM, self._rows_eM, M).reshape(-1)
        return jnp.zeros((M + 1, D), y_RD.dtype).at[flat].set(back_eMD.reshape(-1, D))[:M]
