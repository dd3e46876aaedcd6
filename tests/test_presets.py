"""Every shipped preset trains: each shrunk to CPU size with its traits kept (helpers.shrunk), in the
default dtypes (bf16 compute, f32 weights), through the unchunked and the chunked loss head."""

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import build, preset_names, shrunk
from maxlite import config as C, mesh as mesh_lib
from maxlite.data.synthetic import make_synthetic_iterator
from maxlite.state import split_trainable


def _traits(cfg) -> tuple:
    """What a shrunk preset keeps that changes its program: family, head, biases, RoPE scaling (and its
    kind) and local RoPE, a window, query scaling, the layer count (a family's pattern; Gemma 4's
    key/value-sharing layers), multi-token prediction, per-layer embeddings and a vision tower. Presets that differ
    only in GQA or not, or in a head_dim that is or is not emb/heads, share one run: those are shapes
    the same program takes (the groups below still hold both kinds of each), which the attention
    tests vary for every implementation."""
    return (cfg.decoder_block, cfg.logits_via_embedding, cfg.use_bias, cfg.rope_scaling_factor > 0,
            cfg.rope_scaling_type if cfg.rope_scaling_factor > 0 else "", cfg.sliding_window > 0,
            cfg.local_rope_max_timescale > 0, cfg.query_pre_attn_scalar > 0, cfg.base_num_decoder_layers,
            cfg.mtp_num_layers > 0, cfg.num_kv_shared_layers > 0, cfg.per_layer_embed_dim > 0, cfg.vision_encoder)


def _distinct(argvs: dict[str, list[str]]) -> dict[tuple, list[str]]:
    """Presets whose shrunk models have the same traits share one run (their names in its id)."""
    groups: dict[tuple, list[str]] = {}
    for name, argv in argvs.items():
        groups.setdefault(_traits(C.load(argv)), []).append(name)
    return groups


def _head(cfg) -> tuple:
    """What the chunked loss head does differently: tied to the embedding, soft-capped logits."""
    return cfg.logits_via_embedding, cfg.final_logit_softcapping > 0


_GROUPS = list(_distinct({name: shrunk(name) for name in preset_names()}).values())
# every group through the unchunked head; one tied group per kind of head through the chunked one
# too (a dense one where there is one: the cheaper program)
_TIED: dict[tuple, list[str]] = {}
for _g in sorted(_GROUPS, key=lambda g: C.load(shrunk(g[0])).num_experts > 0):
    _cfg = C.load(shrunk(_g[0]))
    if _cfg.logits_via_embedding:
        _TIED.setdefault(_head(_cfg), _g)
_CASES = [(g, 1) for g in _GROUPS] + [(g, 2) for g in _TIED.values()]
_IDS = [f"{'+'.join(g)}-chunks{n}" for g, n in _CASES]


@pytest.mark.parametrize("names, loss_chunks", _CASES, ids=_IDS)
def test_every_preset_trains_two_steps_in_the_default_dtypes(names, loss_chunks):
    """Two steps run, their losses are finite and every trained parameter moved at some step (the tied
    head too), the frozen ones (a vision tower, vision_train=frozen; DeepSeek-V4's hash-routing tables) not at all. At some step, not after
    both: a routing bias moves by ± its rate per step against the step's load, so a second step whose
    load flipped side puts it back exactly (the shrunk deepseek-v3 does)."""
    cfg, mesh, state, step, sharding = build(shrunk(names[0]) + [f"num_vocab_tiling={loss_chunks}"], 1)
    assert (cfg.dtype, cfg.weight_dtype) == ("bfloat16", "float32")
    before = jax.device_get(nnx.to_pure_dict(state.params))
    frozen = split_trainable(state.params)[1]
    still = {jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(frozen))} if frozen is not None else set()
    assert bool(still) == bool(cfg.vision_encoder or cfg.num_hash_layers)
    seen = []
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(2):
            state, metrics = step(state, {k: jax.device_put(v, sharding) for k, v in next(data).items()})
            assert np.isfinite(float(metrics["loss"]))
            seen.append(jax.device_get(nnx.to_pure_dict(state.params)))
    for path, old in jax.tree_util.tree_leaves_with_path(before):
        news = [np.asarray(_at(after, path)) for after in seen]
        if jax.tree_util.keystr(path) in still:
            assert all(np.array_equal(new, old) for new in news), jax.tree_util.keystr(path)
            continue
        assert np.all(np.isfinite(news[-1])) and any(not np.array_equal(new, old) for new in news), \
            jax.tree_util.keystr(path)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.parametrize("name", preset_names())
def test_parameter_count_equals_the_hugging_face_model_of_the_same_config(name):
    """The preset exported as config.json, the model transformers builds from it (on the meta
    device: no memory) has exactly our parameter count (tied heads counted once; the buffers stored with
    the weights counted as the parameters they are here: DeepSeekMoE's routing bias, Gemma 4's
    layer_scalar)."""
    import torch
    import transformers

    from maxlite.bridge.hf import adapter
    from maxlite.models.families import family
    from maxlite.models.flops import param_count
    from maxlite.state import abstract_params
    from tests import hf_models

    cfg = C.load(["base.yml", f"model_name={name}"])
    config = transformers.AutoConfig.for_model(**adapter(family(cfg).hf_module).hf_config(cfg))
    with torch.device("meta"):
        # a preset with its tower: the image-text class a user loads it with
        auto = transformers.AutoModelForImageTextToText if cfg.vision_encoder else hf_models.auto_class(config.model_type)
        model = auto.from_config(config)
    assert type(model).__name__ == config.architectures[0]
    params = abstract_params(cfg)[1]
    # transformers builds no multi-token-prediction depths (DeepSeek-V3's: it skips their weights)
    mtp = param_count(params["mtp"]) if cfg.mtp_num_layers else 0
    # and the persistent buffers its checkpoints hold (DeepSeek-V3's expert bias: our routed_bias)
    stored = sum(b.numel() for name, b in model.named_buffers() if name in model.state_dict())
    assert sum(p.numel() for p in model.parameters()) + stored == param_count(params) - mtp
