"""Pipeline parallelism: the scanned stack of layers split into stages over the `stage` mesh axis,
micro-batches flowing through them (GPipe), or going round them several times (the circular
schedule, num_pipeline_repeats > 1: a smaller bubble).

Shape legend as in layers.py, plus P stages, R repeats, S units (scanned steps) per stage and
repeat, M micro-batches, b rows per micro-batch.

The stack stays stored in model order [P·R·S, ...]: a checkpoint does not depend on the pipeline.
Its layer dim is sharded over `stage` (mesh.RULES: `layers`), so with R = 1 stage s holds its own
consecutive layers. Unit l = (r·P + s)·S + j runs on stage s in repeat r at position j; with R > 1
stage s needs the non-adjacent groups r·P + s, which the layer dim's contiguous shards do not hold,
so the weights are moved to the [R, P, S] layout inside the step (an all-to-all of the stack's
weights in the forward pass, and of their gradients in the backward pass).

The schedule: at iteration t = 0 .. R·M + P − 2, stage s works on micro-batch m = (t − s) mod M of
repeat r = (t − s) div M when 0 ≤ t − s < R·M, and idles otherwise (the bubble: (P − 1) /
(R·M + P − 1) of the iterations). Stage 0 reads micro-batch m from `pending` [M, b, T, D] (first
the embedded micro-batches, later what the last stage wrote back); every stage's output moves to
the next stage (a shift along the stage dim: one collective permute of [b, T, D] per stage and
iteration); the last stage's goes back to `pending`. With M ≥ P, micro-batch m's output of repeat r
is written (iteration r·M + m + P − 1) before repeat r + 1 reads it (iteration (r + 1)·M + m), and
after the last iteration `pending` holds the stack's output.

Every stage holds `pending`, so every stage holds the stack's output for its batch shard's rows. The
output head and the loss after it take them split over `stage` as well (mesh.RULES'
`activation_batch`): each stage computes the head for 1/P of the rows, a local slice of `pending`
(forward) whose gradient is gathered over `stage` (backward), rather than P stages each computing it
for all the rows. Inside the pipeline, and for the embedding that fills `pending`, a stage's rows
are split over the other batch axes only (`stage_rules`).

Remat (`remat_policy`, around each unit, and with set_remat_policy_on_pipeline_iterations around each
iteration as well, so that an iteration keeps only its stage's input for the backward pass):
`offload_layer_inputs` sends each iteration's stage input to pinned host memory and recomputes the
stage's units from it (`full` inside the stage). Offloading every unit's input inside the two loops
instead is what libtpu 0.0.42.1 refuses (`INTERNAL: ... Bitcast cannot have different memory spaces`);
set_remat_policy_on_pipeline_iterations=false still asks for that.

Between stages travel the hidden states alone: a model whose sides ride in the layers' carry
(maxlite/models/sides.py `travels`: per-layer inputs, state the layers pass on) is refused by the
recipe's validation (config_checks); a side that lives in the layers' weights only runs as it does
unpipelined.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import linen as nn, nnx
from jax.ad_checkpoint import checkpoint_name

from maxlite.models.carry import Carry
from maxlite.models.layers import BTD, constrain

STAGE_BTD = ("activation_stage", *BTD)  # a stage's slot of the buffer between stages
# the micro-batches, each sharded as the batch is
MICRO_BTD, MICRO_BT = (None, *BTD), (None, *BTD[:2])
ITERATION_INPUT = "pipeline_iteration_input"  # a stage's input in one iteration (checkpoint_name)
_OFFLOAD_ITERATION_INPUTS = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=[ITERATION_INPUT], offload_src="device",
    offload_dst="pinned_host")


def num_stages(cfg) -> int:
    return cfg.axis_size("stage")


def stage_rules() -> tuple:
    """The active logical-axis rules with `activation_batch` not split over `stage`: the rows a stage
    works on inside the pipeline (all its batch shard's rows)."""
    def drop_stage(axes):
        return tuple(a for a in axes if a != "stage") if isinstance(axes, tuple) else axes
    return tuple((name, drop_stage(axes) if name == "activation_batch" else axes)
                 for name, axes in nn.get_logical_axis_rules())


def feeding(cfg):
    """The rules under which the embedding runs: with stages it fills the pipeline's `pending`, which
    every stage holds whole (splitting it over `stage` would only add a gather of it)."""
    return nnx.logical_axis_rules(stage_rules()) if num_stages(cfg) > 1 else contextlib.nullcontext()


def run(cfg, stack, x_BTD, positions_BT, segment_ids_BT, local: tuple[bool, ...], policy):
    """(x_BTD after the stack's layers, their routing statistics stacked in layer order or None):
    what Transformer._run_layers returns, computed by the pipeline; x_BTD leaves with its rows split
    over `stage` as well (for the output head). `stack` is the scanned stack (units with a leading
    layer dim), `local` each layer's sliding-window flag, `policy` the remat policy (None: no remat)."""
    with nnx.logical_axis_rules(stage_rules()):
        x_BTD, stats = _run(cfg, stack, x_BTD, positions_BT, segment_ids_BT, local, policy)
    return constrain(x_BTD, BTD), stats


def _run(cfg, stack, x_BTD, positions_BT, segment_ids_BT, local, policy):
    P, R, M = num_stages(cfg), cfg.pipeline_repeats, cfg.pipeline_microbatches
    graphdef, state = nnx.split(stack)
    count = jax.tree.leaves(state)[0].shape[0]
    S, n = count // (P * R), len(local) // count
    weights = jax.tree.map(lambda w: _to_stages(w, R, P, S), state)
    flags = _to_stages(jnp.asarray(local).reshape((count,) if n == 1 else (count, n)), R, P, S)
    static = local[0] if len(set(local)) == 1 else None  # every layer alike: a constant flag
    per_iteration = policy is not None and cfg.set_remat_policy_on_pipeline_iterations
    # offloading: each iteration's input goes to the host, the stage's units are recomputed from it
    offload = per_iteration and cfg.remat_policy == "offload_layer_inputs"
    stage_fn = jax.vmap(_stage_fn(graphdef, static, jax.checkpoint_policies.nothing_saveable if offload else policy),
                        spmd_axis_name="stage")
    if per_iteration:
        # without it the backward pass keeps the inputs of a stage's S layers for each of the R·M + P − 1
        # iterations (the bubble's too); with it, each iteration's input [b, T, D] alone, and the S
        # layers' inputs of one iteration at a time while its backward pass recomputes them
        stage_fn = jax.checkpoint(stage_fn, policy=_OFFLOAD_ITERATION_INPUTS if offload else policy,
                                  prevent_cse=False)

    B, T, D = x_BTD.shape
    pending_MbTD = constrain(_split(x_BTD, M), MICRO_BTD)
    positions_MbT = constrain(_split(positions_BT, M), MICRO_BT)
    segment_ids_MbT = constrain(_split(segment_ids_BT, M), MICRO_BT)
    stages_P = jnp.arange(P)

    def iteration(carry, t):
        buffer_PbTD, pending_MbTD, stats_acc = carry
        work_P = t - stages_P
        valid_P = (work_P >= 0) & (work_P < R * M)
        micro_P, repeat_P = jnp.mod(work_P, M), jnp.clip(work_P // M, 0, R - 1)
        first = (stages_P == 0)[:, None, None, None]
        buffer_PbTD = constrain(_select(first, _pick(pending_MbTD, t % M)[None], buffer_PbTD), STAGE_BTD)
        out_PbTD, stats = stage_fn(weights, flags, repeat_P, buffer_PbTD, positions_MbT[micro_P],
                                   segment_ids_MbT[micro_P])
        last = (t - (P - 1)) % M
        done = valid_P[P - 1]
        put_M = (jnp.arange(M) == last) & done
        pending_MbTD = constrain(_select(put_M[:, None, None, None], out_PbTD[P - 1][None], pending_MbTD), MICRO_BTD)
        if stats is not None:  # sums over tokens: a layer's over the micro-batches are its over the batch
            hit_RP = jax.nn.one_hot(repeat_P, R, axis=0) * valid_P
            stats_acc = jax.tree.map(
                lambda acc, s: acc + hit_RP.reshape(R, P, *(1,) * (s.ndim - 1)) * s[None], stats_acc, stats)
        return (constrain(jnp.roll(out_PbTD, 1, axis=0), STAGE_BTD), pending_MbTD, stats_acc), None

    buffer_PbTD = constrain(jnp.zeros((P, B // M, T, D), x_BTD.dtype), STAGE_BTD)
    stats_shape = jax.eval_shape(stage_fn, weights, flags, jnp.zeros(P, jnp.int32), buffer_PbTD,
                                 positions_MbT[:P], segment_ids_MbT[:P])[1]
    stats_acc = jax.tree.map(lambda s: jnp.zeros((R, *s.shape), jnp.float32), stats_shape)
    (_, pending_MbTD, stats_acc), _ = jax.lax.scan(iteration, (buffer_PbTD, pending_MbTD, stats_acc),
                                                   jnp.arange(R * M + P - 1))
    x_BTD = constrain(jnp.swapaxes(pending_MbTD, 0, 1).reshape(B, T, D), BTD)
    if stats_shape is None:
        return x_BTD, None
    # [R, P, S, ...] → units in model order; a unit's MoE layers [.., m, ...] → layers in model order
    units = jax.tree.map(lambda a: a.reshape(R * P * S, *a.shape[3:]), stats_acc)
    return x_BTD, units if n == 1 else jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), units)


def _stage_fn(graphdef, static, policy):
    """One stage's S units applied in turn in its repeat r (a scan, with the run's remat policy
    around each unit). The unit's weights of repeat r are picked inside the rematerialised body, from
    loop-invariant [S, R, ...] weights: the backward pass keeps no per-iteration copy of them."""
    def stage(weights_SR, flags_SR, r, x_bTD, positions_bT, segment_ids_bT):
        x_bTD = checkpoint_name(x_bTD, ITERATION_INPUT)

        def body(x_bTD, unit_and_flags):
            state_R, flags_R = unit_and_flags
            unit = nnx.merge(graphdef, jax.tree.map(lambda w: w[r], state_R))
            flag = flags_R[r] if static is None else static
            carry, stats = unit(Carry(checkpoint_name(x_bTD, "decoder_layer_input")), positions_bT, segment_ids_bT,
                                None, flag)
            return carry.x_BTD, stats
        if policy is not None:
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        return jax.lax.scan(body, x_bTD, (weights_SR, flags_SR))
    return stage


def _pick(x_M, i):
    """x_M[i] by a mask over the micro-batch dim: the TPU partitioner turned the dynamic slice into
    an all-gather of every micro-batch's rows on every chip (128 GiB per chip for Llama 3.1-405B
    at 8,192 tokens)."""
    mask = (jnp.arange(x_M.shape[0]) == i).reshape(-1, *(1,) * (x_M.ndim - 1))
    return jnp.sum(_select(mask, x_M, jnp.zeros((), x_M.dtype)), axis=0)


@jax.checkpoint
def _select(mask, a, b):
    """jnp.where(mask, a, b) for the schedule's selects and the micro-batch picks (_pick), whose
    backward pass keeps the small mask (e.g. [P, 1, 1, 1]) of each iteration, not the mask broadcast to the hidden states' shape (pred [iterations, P, b, T, D] in
    the compiled TPU step: 3.5 GiB per chip for Llama 3.1-405B over 3 repeats)."""
    return jnp.where(mask, a, b)


def _to_stages(w, R: int, P: int, S: int):
    """A stacked weight [R·P·S, ...] in model order → [P, S, R, ...]: stage s's units, position j,
    repeat r (the stage dim on `stage`)."""
    return jnp.moveaxis(w.reshape(R, P, S, *w.shape[1:]), 0, 2)


def _split(x, M: int):
    """[B, ...] → [M, B/M, ...]: micro-batch i takes rows i, i + M, ..., so each keeps rows its
    devices already hold."""
    return jnp.swapaxes(x.reshape(x.shape[0] // M, M, *x.shape[1:]), 0, 1)
