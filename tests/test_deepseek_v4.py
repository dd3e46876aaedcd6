"""DeepSeek-V4: its three attentions (the `v4_*` mixer kinds: a sliding window alone, with heavily
compressed entries, with compressed entries a lightning indexer picks), hyper-connections, √softplus
routing with hash-routed first layers and clamped SwiGLU experts.

A random model built by transformers (tests/hf_models.py: one layer of each attention and a second
heavily compressed one, 3 residual streams, the first layer hash-routed, YaRN on the compressed
layers' RoPE) imports, gives float32 logits within 1e-5 relative over 40 tokens (five windows of the
heavily compressed layers, ten of the sparse one), decodes greedily to transformers' own tokens past
every window (a batch of prompts of different lengths equal to each alone), and exports so that
transformers loads a DeepseekV4ForCausalLM with the same logits. A packed row of two documents gives
each the logits it has alone (each document's windows are its own); training sends the indexer's
loss to the indexer alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from maxlite.bridge import hf
from tests.helpers import assert_greedy_like_transformers, imported_random_model, jax_logits, relative, torch_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 256


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the transformers model, its directory, maxlite's import of it)."""
    return imported_random_model(tmp_path_factory, "deepseek_v4", ["max_target_length=64"])


def _model(cfg, pure):
    from maxlite.state import abstract_params

    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def test_import_gives_transformers_logits(imported):
    from maxlite.models.layout import layer_kinds

    model, _, cfg, pure = imported
    assert cfg.decoder_block == "deepseek_v4" and (cfg.hc_mult, cfg.num_hash_layers) == (3, 1)
    assert [(k.mixer, k.ffn) for k in layer_kinds(cfg)] == [("v4_sliding", "hash_moe"), ("v4_hca", "moe"),
                                                            ("v4_csa", "moe"), ("v4_hca", "moe")]
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.compress_rope_max_timescale) == ("yarn", 4.0, 160000)
    ids = np.random.default_rng(1).integers(0, V, (2, 40))
    theirs = torch_logits(model, ids)
    assert relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5
    # the hash table chooses the first layer's experts: another table is another model
    import copy

    from maxlite.bridge import params as P
    from maxlite.models.layout import layer_place
    block, index = layer_place(cfg, 0)
    assert block == ("hash_layers",) and index == 0  # the hash-routed layers stored apart: the rest repeats
    shuffled = copy.deepcopy(pure)
    table = P.get(P.get(shuffled, block), ("mlp", "tid2eid"))
    table[index] = table[index][::-1]
    assert relative(jax_logits(cfg, shuffled, ids), theirs) > 1e-3


def test_greedy_decoding_equals_transformers_and_a_batch_equals_each_alone(imported):
    """32 new tokens from batched prompts of different lengths (right-padded), past the sliding window
    (8) and many windows of the compressed layers (8 and 4), from the decode cache
    (maxlite/models/v4_cache.py); each prompt alone decodes the same."""
    model, _, cfg, pure = imported
    assert_greedy_like_transformers(cfg, pure, model, 32, [list(range(100, 120)), [7, 8, 9]], alone=True)


def test_export_loads_in_transformers_with_the_same_logits(imported):
    model, path, cfg, pure = imported
    hf.export_hf(cfg, pure, str(path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    assert back.config.layer_types == model.config.layer_types
    assert back.config.mlp_layer_types == model.config.mlp_layer_types
    assert back.config.rope_parameters == model.config.rope_parameters
    for name in ("hc_mult", "index_topk", "o_groups", "compress_rates", "swiglu_limit", "scoring_func"):
        assert getattr(back.config, name) == getattr(model.config, name), name
    ids = np.random.default_rng(2).integers(0, V, (1, 40))
    assert relative(torch_logits(back, ids), torch_logits(model, ids)) <= 1e-6


def test_deepseeks_own_release_names_import_with_the_same_logits(imported, tmp_path, capfd):
    """DeepSeek publishes V4 under its own names: no `model.` prefix, `embed.weight`, the output head's
    hyper-connection as `hc_head_fn`, and multi-token-prediction layers (`mtp.*`). Those names, as
    DeepSeek's inference code spells them, are what transformers' own loader reads (no missing or
    unexpected tensor); maxlite imports them to the same logits and leaves the mtp layers out, said."""
    from safetensors.numpy import load_file, save_file

    model, path, _, _ = imported
    tensors = {}
    for f in sorted((path / "hf").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    release = {}
    for name, t in tensors.items():
        name = name.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
        release[name] = t
    release["mtp.0.attn.wq_a.weight"] = tensors["model.layers.0.attn.wq_a.weight"]
    assert "embed.weight" in release and not any(n.startswith("model.") for n in release)
    out = tmp_path / "release"
    out.mkdir()
    save_file(release, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in (path / "hf").iterdir():
        if f.suffix == ".json" and "safetensors" not in f.name:
            (out / f.name).write_bytes(f.read_bytes())
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    ids = np.random.default_rng(4).integers(0, V, (1, 40))
    assert relative(torch_logits(theirs, ids), torch_logits(model, ids)) <= 1e-6
    capfd.readouterr()
    cfg, pure = hf.import_hf(str(out), ["max_target_length=64"])
    assert "1 tensors of the multi-token-prediction layers (mtp.*) not imported" in capfd.readouterr().err
    assert relative(jax_logits(cfg, pure, ids), torch_logits(model, ids)) <= 1e-5


def test_a_packed_row_gives_each_document_its_logits_alone(imported):
    """Two documents in one row (positions from 0 each, segments 1 and 2), the second starting at an
    offset no window size divides: each document's windows are its own, so its logits are those it
    has alone."""
    _, _, cfg, pure = imported
    model = _model(cfg, pure)
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, V, 21), rng.integers(0, V, 19)
    row = np.concatenate([a, b])[None]
    positions = np.concatenate([np.arange(21), np.arange(19)])[None]
    segments = np.concatenate([np.full(21, 1), np.full(19, 2)])[None].astype(np.int32)
    forward = nnx.jit(lambda m, *args: m(*args))
    packed = np.asarray(forward(model, row, positions, segments))[0]
    np.testing.assert_allclose(packed[:21], jax_logits(cfg, pure, a[None])[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[21:], jax_logits(cfg, pure, b[None])[0], rtol=1e-5, atol=1e-5)


def test_training_sends_the_indexers_loss_to_the_indexer_alone(imported):
    """The sparse layer's indexer gets the gradient of Σ_t KL(the heads' attention over its chosen
    entries ‖ softmax(its scores of them)) and nothing from the language model (its choice is
    discrete); the other parameters get the language model's alone."""
    from maxlite.models import dsa

    _, _, cfg, pure = imported
    f32 = dataclasses.replace(cfg, dtype="float32")
    layer = _model(f32, pure).blocks()[2].attn  # the compressed sparse layer
    B, T = 2, 24
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.base_emb_dim))
    positions, segments = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32)
    probe = jax.random.normal(jax.random.key(2), (B, T, cfg.base_emb_dim))
    graphdef, params = nnx.split(layer, nnx.Param)

    def objective(params):  # a language model's loss stands in: any function of the layer's output
        return jnp.sum(nnx.merge(graphdef, params)(x, positions, segments) * probe)

    got = nnx.to_pure_dict(jax.grad(objective)(params))
    original = dsa.with_indexer_loss
    try:
        from maxlite.models import v4_attention
        v4_attention.with_indexer_loss = lambda out, *_: out  # the language model's gradient alone
        lm = nnx.to_pure_dict(jax.grad(objective)(params))
    finally:
        v4_attention.with_indexer_loss = original
    assert all(np.any(g != 0) for g in jax.tree.leaves(got["indexer"]))
    assert all(not np.any(g) for g in jax.tree.leaves(lm["indexer"]))  # the language model's loss leaves it
    for name in set(got) - {"indexer"}:
        for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(lm[name])):
            np.testing.assert_array_equal(a, b)


def test_what_is_not_modelled_is_refused_in_one_line():
    from maxlite import config as C
    from maxlite.config_checks import check_layout
    from maxlite.families.deepseek_v4 import hf as adapter

    cfg = C.load(["base.yml", "model_name=deepseek-v4-flash", "num_hash_layers=0", "ici_pipeline_parallelism=2"])
    with pytest.raises(C.ConfigError, match="not hyper-connections' hc_mult=4 streams"):
        check_layout(cfg, 1)
    with pytest.raises(C.ConfigError, match="q_proj is not a projection of this model"):  # not a silent full fine-tune
        C.load(["base.yml", "model_name=deepseek-v4-flash", "lora_rank=4", "lora_targets=[q_proj]"])
    with pytest.raises(C.ConfigError, match="lora_targets='o_a_proj': choose one of"):  # block-diagonal: PEFT cannot adapt it
        C.load(["base.yml", "model_name=deepseek-v4-flash", "lora_rank=4", "lora_targets=[o_a_proj]"])
    with pytest.raises(C.ConfigError, match="o_groups=3 must divide"):
        C.load(["base.yml", "model_name=deepseek-v4-flash", "o_groups=3"])
    llama3 = C.load(["base.yml", "model_name=deepseek-v4-flash", "rope_scaling_factor=8"])  # llama3 scaling
    with pytest.raises(ValueError, match="YaRN only"):
        adapter.hf_config(llama3)
