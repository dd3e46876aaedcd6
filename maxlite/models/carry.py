"""The one value that travels through the layer stack: the hidden states and the sides' parts
(maxlite/models/sides.py). A block takes a Carry and gives one back without looking inside `state` or
`inputs`; the kinds and side steps that own an entry read and write it.

Shape legend as in layers.py, plus L layers.
"""

from __future__ import annotations

import dataclasses

import jax

from maxlite.models.sides import sides


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
    x_BTD: jax.Array
    # side name → what layers read and write as the stack runs (Gemma 4's "kv": variant → (k, v) of the
    # last layer of that kind with keys and values of its own; the sharing mixer kinds read it)
    state: dict = dataclasses.field(default_factory=dict)
    # side name → this layer's own input (Gemma 4's "per_layer" [B, T, P]); the stack holds them [L, ...]
    # and scans them with the layers, so between layers it is empty
    inputs: dict = dataclasses.field(default_factory=dict)

    def replace(self, **changes) -> "Carry":
        return dataclasses.replace(self, **changes)

    def with_inputs(self, inputs: dict) -> "Carry":
        """The carry as a layer (or a unit of layers) reads it: with its own inputs."""
        return self.replace(inputs=inputs)

    def without_inputs(self) -> "Carry":
        """What the next layer receives (its inputs are its own, scanned)."""
        return self.replace(inputs={})


def start(cfg, x_BTD) -> Carry:
    """The carry before the first layer: the embedded tokens and each stateful side's start."""
    return Carry(x_BTD, {s.name: s.load("start")(cfg, x_BTD) for s in sides(cfg) if s.start})


def layer_inputs(model, inputs_BT, x_BTD, seen: dict | None = None) -> dict:
    """Every layer's inputs, side name → [L, ...] (layer i's at [i]), from the token ids, their
    embeddings and what the model saw in the prompt's images (`seen`: maxlite/models/vision/merge.py);
    {} for a model without such sides. A side with nothing for these tokens (DeepStack without images)
    has no entry."""
    out = {s.name: s.load("inputs")(model, inputs_BT, x_BTD, seen or {}) for s in sides(model.cfg) if s.inputs}
    return {name: value for name, value in out.items() if value is not None}
