"""What travels through the layer stack beside the hidden states: the layers' SIDE features, and the
one typed carry (`maxlite.models.carry.Carry`) they ride in.

A side is a model feature that is neither a mixer nor a feed-forward kind but reaches into every
layer: per-layer inputs the model computes once and each layer reads its slice of (Gemma 4's
per-layer embeddings), state that layers read and write as the stack runs (Gemma 4's shared keys and
values: the sharing mixer kinds read what an earlier layer of their kind wrote), and a step every
layer ends with (Gemma 4's per-layer branch, its `layer_scalar`). The transformer, its blocks,
decoding and the pipeline read this table; none of them names a side. A side's parameters keep the
names they always had: `name` on each block (its layer part) and on the model (its model part).

Pure data: importable without JAX (config validation reads which sides a recipe has).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from maxlite.models.families import family
from maxlite.models.names import image_blocks


@dataclasses.dataclass(frozen=True)
class Side:
    name: str                   # its key in the carry, and its parameters' name on the block / the model
    title: str                  # what a refusal calls it
    wanted: Callable            # (cfg) → whether the model has it
    layer: str = ""             # "module:function(cfg, rngs)": the part each block stores as `name`
    finish: str = ""            # "module:function(part, x_BTD, carry) → x_BTD": after the feed-forward
                                # (part: the block's `name` attribute, None without a layer part)
    model: str = ""             # "module:Class(cfg, rngs=)": the part the model stores as `name`
    inputs: str = ""            # "module:function(model, inputs_BT, x_BTD, seen) → [L, ...] | None": each
                                # layer's input (the carry's `inputs[name]`, scanned with the layers);
                                # `seen`: what the vision encoder gave (models/vision/merge.py)
    start: str = ""             # "module:function(cfg, x_BTD) → state": what the carry's `state[name]`
                                # holds before the first layer (the mixers that read it write it)
    mixer_arg: str = ""         # the keyword the layer's mixer takes its input as (in training and in
                                # the decode prefill); "": the mixer does not read it
    ffn_arg: str = ""           # the keyword a feed-forward kind with `side_args` takes its input as

    def load(self, field: str):
        path, attr = getattr(self, field).split(":")
        return getattr(importlib.import_module(path), attr)

    @property
    def travels(self) -> bool:
        """It rides in the carry beside the hidden states (inputs or state), not only in the layers' weights."""
        return bool(self.inputs or self.start)


# in the order a block creates its parts (its parameters' random numbers follow that order)
SIDES = (
    Side("kv", "Gemma 4's shared keys/values (num_kv_shared_layers)", lambda cfg: bool(cfg.num_kv_shared_layers),
         start="maxlite.models.gemma4:shared_kv_start"),
    Side("per_layer", "Gemma 4's per-layer embeddings (per_layer_embed_dim)", lambda cfg: bool(cfg.per_layer_embed_dim),
         layer="maxlite.models.gemma4:PerLayerBranch", finish="maxlite.models.gemma4:per_layer_finish",
         model="maxlite.models.gemma4:PerLayerInputs", inputs="maxlite.models.gemma4:per_layer_inputs"),
    Side("layer_scalar", "each layer's stored output scale (layer_scalar)", lambda cfg: family(cfg).layer_scalar,
         layer="maxlite.models.gemma4:layer_scalar", finish="maxlite.models.gemma4:scale_finish"),
    Side("image_blocks", "bidirectional attention within each image (the vision encoder's image_blocks)",
         image_blocks, inputs="maxlite.models.vision.merge:image_block_inputs", mixer_arg="blocks_BT"),
    Side("deepstack", "Qwen3-VL's DeepStack (vision_deepstack_layers)", lambda cfg: bool(cfg.vision_deepstack_layers),
         finish="maxlite.models.vision.merge:deepstack_finish", inputs="maxlite.models.vision.merge:deepstack_inputs"),
    Side("token_ids", "DeepSeek-V4's hash routing (num_hash_layers)", lambda cfg: bool(cfg.num_hash_layers),
         inputs="maxlite.models.moe:token_id_inputs", ffn_arg="token_ids_BT"),
)


def sides(cfg) -> tuple[Side, ...]:
    """The model's sides, in the table's order."""
    return tuple(s for s in SIDES if s.wanted(cfg))


def mixer_args(mixer_sides, inputs: dict) -> dict:
    """The keywords a layer's mixer takes from its inputs (`mixer_sides`: the sides with a `mixer_arg`)."""
    return {side.mixer_arg: inputs[side.name] for side in mixer_sides if side.name in inputs}


def ffn_args(ffn_sides, inputs: dict) -> dict:
    """The keywords a layer's feed-forward takes from its inputs (`ffn_sides`: the sides with an
    `ffn_arg`, for a feed-forward kind with `side_args`)."""
    return {side.ffn_arg: inputs[side.name] for side in ffn_sides if side.name in inputs}
