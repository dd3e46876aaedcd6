"""How a scanned model stores its layers (maxlite/models/layout.py `layer_stacks`): the repeats of the
shortest unit scanned, and where a pattern does not repeat to its end (Kimi Linear, Nemotron-H) the
layers left over in a stack of their own, `tail_layers`, rather than every layer in one unit (which
XLA compiles as that many inlined layers)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import config as C
from maxlite.models.layout import layer_kinds, layer_place, layer_stacks


def _stacks(*argv):
    return [(s.name, s.count, len(s.unit)) for s in layer_stacks(C.load(["base.yml", *argv]))]


def test_the_published_patterns_that_do_not_repeat_to_their_end_keep_a_tail():
    # Kimi Linear 48B: a dense layer, then (KDA ×3 around latent attention) six times, then KDA and latent
    assert _stacks("model_name=kimi-linear-48b-a3b") == [("dense_layers", 1, 1), ("layers", 6, 4), ("tail_layers", 1, 2)]
    assert _stacks("model_name=nemotron-h-8b") == [("layers", 4, 11), ("tail_layers", 1, 8)]
    assert _stacks("model_name=nemotron-h-56b") == [("layers", 10, 11), ("tail_layers", 1, 8)]
    # what repeats to its end keeps one stack; a tail as long as a unit is no gain (Qwen3.5's tiny 3 : 1)
    assert _stacks("model_name=qwen3-next-80b-a3b") == [("layers", 12, 4)]
    assert _stacks("model_name=tiny-hybrid") == [("layers", 1, 4)]


@pytest.mark.parametrize("model", ["kimi-linear-48b-a3b", "nemotron-h-8b"])
def test_every_layer_has_one_place_and_the_stacks_keep_the_layer_order(model):
    cfg = C.load(["base.yml", f"model_name={model}"])
    kinds = layer_kinds(cfg)
    places = [layer_place(cfg, i) for i in range(cfg.base_num_decoder_layers)]
    assert len(set(places)) == len(places)
    for stack in layer_stacks(cfg):
        for j in range(stack.count * len(stack.unit)):  # the unit's structure is the layer's own
            assert (kinds[stack.first + j].mixer, kinds[stack.first + j].ffn) == stack.unit[j % len(stack.unit)]
    assert [p[0][0] for p in places] == sorted((p[0][0] for p in places), key=[s.name for s in layer_stacks(cfg)].index)


def test_a_model_with_a_tail_computes_what_its_layers_unrolled_do():
    """Five hybrid layers (delta-net, attention, delta-net, attention, delta-net): two scanned units of
    two and the last delta-net layer in `tail_layers`; the same seed unrolled gives the same logits."""
    from maxlite.models.transformer import Transformer

    argv = ["base.yml", "model_name=tiny-hybrid", "dtype=float32", "base_num_decoder_layers=5", "base_emb_dim=64",
            "base_mlp_dim=96", "head_dim=16", "gdn_key_head_dim=16", "gdn_value_head_dim=16", "vocab_size=128",
            "layer_types=[linear_attention,full_attention,linear_attention,full_attention,linear_attention]"]
    scanned, unrolled = C.load(argv), C.load(argv + ["scan_layers=false"])
    assert [(s.name, s.count, len(s.unit)) for s in layer_stacks(scanned)] == [("layers", 2, 2), ("tail_layers", 1, 1)]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 24)))
    pos, seg = jnp.broadcast_to(jnp.arange(24), (2, 24)), jnp.ones((2, 24), jnp.int32)
    logits = []
    for cfg in (scanned, unrolled):
        with nnx.use_eager_sharding(False):
            model = Transformer(cfg, rngs=nnx.Rngs(0))
        logits.append(np.asarray(nnx.jit(lambda m: m(ids, pos, seg))(model)))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
