"""The alignment objectives' reference policy, kept in the optimizer state.

DPO and GRPO compare the policy with a frozen reference: the weights the run started from, or
those at the end of its warm-up steps (`alignment_sft_steps`). `wrap(tx)` adds a copy of the
trainable weights to the optimizer state, so the reference is sharded like the policy (optax maps
its shardings like Adam's moments), checkpointed, snapshotted and restored with everything else,
and a params-only start (`load_parameters_path`) makes the loaded weights the reference. With LoRA
only the adapters are trainable: the reference is the frozen base with the copied adapters (B = 0
at the start: the base model itself), costing the adapters' size, not the model's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from maxlite.state import join


class WithReference(NamedTuple):
    inner: optax.OptState
    ref: Any  # the reference's trainable weights (the frozen ones are the policy's own)


def wrap(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    def init(params):
        return WithReference(tx.init(params), jax.tree.map(lambda p: p, params))

    def update(grads, state, params=None):
        updates, inner = tx.update(grads, state.inner, params)
        return updates, WithReference(inner, state.ref)

    return optax.GradientTransformation(init, update)


def policy(opt_state, frozen):
    """The reference's full weights (no gradient flows into them), or None without a reference."""
    if not isinstance(opt_state, WithReference):
        return None
    return join(jax.lax.stop_gradient(opt_state.ref), frozen)


def replace(opt_state, trainable):
    """The same optimizer state with `trainable` as the reference (the end of the warm-up)."""
    return opt_state._replace(ref=trainable) if isinstance(opt_state, WithReference) else opt_state
