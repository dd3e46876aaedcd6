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

import jax
import jax.numpy as jnp
from flax import linen as nn

from maxlite.models import grouped, moe_kernels
from maxlite.models.platform import target_platform


def experts(impl: str, x_BTD, routing: moe_kernels.Routing, slots: int, gate_EDF, up_EDF, down_EFD, glu,
            in_bias: tuple = ()):
    """The routed experts' weighted output [B, T, D] (float32) by `impl`; `glu(gate, up)` the
    family's gated hidden, `in_bias` () or the experts' (gate_bias_EF, up_bias_EF), split like the
    weights' columns."""
    if impl == "dense":
        return moe_kernels.dense(x_BTD, routing, gate_EDF, up_EDF, down_EFD, glu, *in_bias)
    mesh = jax.sharding.get_abstract_mesh()
    local = functools.partial(_local, impl, slots, glu)
    arrays = (routing.experts_BTk, routing.weights_BTk, routing.kept_BTk, routing.slots_BTk)
    if mesh.empty:
        return local(None, None, x_BTD, *arrays, gate_EDF, up_EDF, down_EFD, *in_bias)
    batch = nn.logical_to_mesh_axes(("activation_batch", None, None))
    w_in = nn.logical_to_mesh_axes(("exp", None, "mlp"))
    w_out = nn.logical_to_mesh_axes(("exp", "mlp", None))
    exp_axis, mlp_axis = w_in[0], w_in[2]
    assert exp_axis is None or isinstance(exp_axis, str), exp_axis  # one mesh axis (or none)
    exp_axis = exp_axis if exp_axis and mesh.shape[exp_axis] > 1 else None
    mlp_axis = mlp_axis if mlp_axis and mesh.shape[_one(mlp_axis)] > 1 else None
    body = functools.partial(local, exp_axis, mlp_axis)
    bias_spec = nn.logical_to_mesh_axes(("exp", "mlp"))
    return jax.shard_map(body, mesh=mesh, in_specs=(batch,) * 5 + (w_in, w_in, w_out) + (bias_spec,) * len(in_bias),
                         out_specs=batch, check_vma=False)(x_BTD, *arrays, gate_EDF, up_EDF, down_EFD, *in_bias)


def _one(axes):
    return axes if isinstance(axes, str) else axes[0]


def _local(impl, slots, glu, exp_axis, mlp_axis, x_BTD, experts_BTk, weights_BTk, kept_BTk, slots_BTk,
           gate_EDF, up_EDF, down_EFD, *in_bias):
    """One device's part: its tokens, its experts (all of them without an expert axis)."""
    ep = 1 if exp_axis is None else jax.lax.axis_size(exp_axis)
    E = gate_EDF.shape[0] * ep
    routing = moe_kernels.Routing(experts_BTk, weights_BTk, kept_BTk, slots_BTk, {})

    def partial_sum(y):  # the MLP width split over `mlp`: each device holds part of the output
        return y if mlp_axis is None else jax.lax.psum(y, mlp_axis)

    if impl == "capacity":
        buf_BECD = moe_kernels.capacity_buffers(x_BTD, routing, E, slots)
        if ep > 1:
            buf_BECD = jax.lax.all_to_all(buf_BECD, exp_axis, 1, 0, tiled=True)  # [ep·B, El, C, D]
        y_BECD = partial_sum(moe_kernels.capacity_ffn(buf_BECD, gate_EDF, up_EDF, down_EFD, glu, *in_bias))
        if ep > 1:
            y_BECD = jax.lax.all_to_all(y_BECD, exp_axis, 0, 1, tiled=True)  # back: [B, E, C, D]
        return moe_kernels.capacity_combine(y_BECD, routing)
    B, T, D = x_BTD.shape
    k = experts_BTk.shape[-1]
    order_M, sizes_E = moe_kernels.sort_by_expert(experts_BTk, E)
    x_MD = jnp.take(x_BTD.reshape(B * T, D), order_M // k, axis=0)
    if ep == 1:
        y_MD = partial_sum(grouped.ffn(impl, x_MD, sizes_E, gate_EDF, up_EDF, down_EFD, glu, *in_bias))
    else:
        exchange = Exchange(sizes_E, ep, exp_axis, ragged=target_platform() in ("tpu", "gpu"))
        x_RD, sizes_El, regroup_R = exchange.send(x_MD)
        y_RD = grouped.ffn(impl, x_RD, sizes_El, gate_EDF, up_EDF, down_EFD, glu, *in_bias)
        y_MD = exchange.back(partial_sum(jnp.take(y_RD, jnp.argsort(regroup_R), axis=0)))
    y_XkD = moe_kernels.unsort(y_MD, order_M, k)
    return moe_kernels.combine(y_XkD, weights_BTk.reshape(B * T, k)).reshape(B, T, D)


class Exchange:
    """Rows sorted by expert sent to the devices of their experts and back (the dropless path).

    `send(x_MD)` → (the received rows regrouped by local expert [R, D], their counts [El], the
    permutation that regrouped them); `back(y_RD)` takes results in the received order."""

    def __init__(self, sizes_E, ep: int, axis: str, ragged: bool):
        E = sizes_E.shape[0]
        self.ep, self.axis, self.ragged, self.El = ep, axis, ragged, E // ep
        self.send_sizes = jnp.sum(sizes_E.reshape(ep, self.El), axis=1)  # rows to each device [ep]
        self.send_start = jnp.cumsum(self.send_sizes) - self.send_sizes
        self.all_sizes = jax.lax.all_gather(sizes_E, axis)  # every device's counts [ep, E]
        me = jax.lax.axis_index(axis)
        # rows each source sends me per local expert [ep, El], and in all
        self.mine = jax.lax.dynamic_slice_in_dim(self.all_sizes, me * self.El, self.El, axis=1)
        self.recv_sizes = jnp.sum(self.mine, axis=1)
        self.me = me

    def send(self, x_MD):
        M, D = x_MD.shape
        ep = self.ep
        if self.ragged:
            R = ep * M
            recv_start = jnp.cumsum(self.recv_sizes) - self.recv_sizes
            shard_sizes = jnp.sum(self.all_sizes.reshape(ep, ep, self.El), axis=2)  # [source, dest]
            # where my rows land in each destination's buffer: after those of lower sources
            out_offsets = jnp.sum(jnp.where(jnp.arange(ep)[:, None] < self.me, shard_sizes, 0), axis=0)
            x_RD = jax.lax.ragged_all_to_all(x_MD, jnp.zeros((R, D), x_MD.dtype), self.send_start,
                                             self.send_sizes, out_offsets, self.recv_sizes, axis_name=self.axis)
            source_R = jnp.clip(jnp.searchsorted(jnp.cumsum(self.recv_sizes), jnp.arange(R), side="right"), 0, ep - 1)
            within_R = jnp.arange(R) - recv_start[source_R]
            self._back = (recv_start, shard_sizes, M)
        else:
            R = ep * M
            rows_eM = self.send_start[:, None] + jnp.arange(M)
            ok_eM = jnp.arange(M) < self.send_sizes[:, None]
            buf_eMD = jnp.where(ok_eM[..., None], jnp.take(x_MD, jnp.minimum(rows_eM, M - 1), axis=0), 0)
            x_RD = jax.lax.all_to_all(buf_eMD, self.axis, 0, 0, tiled=True).reshape(R, D)
            source_R, within_R = jnp.arange(R) // M, jnp.arange(R) % M
            self._back = (rows_eM, ok_eM, M)
        # each received row's local expert (El: padding past what its source sent)
        cum_eEl = jnp.cumsum(self.mine, axis=1)
        local_R = jax.vmap(lambda c, w: jnp.searchsorted(c, w, side="right"))(cum_eEl[source_R], within_R)
        regroup_R = jnp.argsort(local_R, stable=True)
        return jnp.take(x_RD, regroup_R, axis=0), jnp.sum(self.mine, axis=0).astype(jnp.int32), regroup_R

    def back(self, y_RD):
        """Results in the received order → my rows' results [M, D], in my sorted order."""
        R, D = y_RD.shape
        if self.ragged:
            recv_start, shard_sizes, M = self._back
            # I return each source its rows: they go where that source's rows for me started
            their_offsets = jnp.sum(jnp.where(jnp.arange(self.ep)[None, :] < self.me,
                                              self.all_sizes.reshape(self.ep, self.ep, self.El).sum(2), 0), axis=1)
            return jax.lax.ragged_all_to_all(y_RD, jnp.zeros((M, D), y_RD.dtype), recv_start, self.recv_sizes,
                                             their_offsets, self.send_sizes, axis_name=self.axis)
        rows_eM, ok_eM, M = self._back
        back_eMD = jax.lax.all_to_all(y_RD.reshape(self.ep, M, D), self.axis, 0, 0, tiled=True)
        flat = jnp.where(ok_eM, rows_eM, M).reshape(-1)
        return jnp.zeros((M + 1, D), y_RD.dtype).at[flat].set(back_eMD.reshape(-1, D))[:M]
