"""DeepSeek-V3.2: DeepSeek sparse attention (the `dsa` mixer kind: latent attention over the tokens a
lightning indexer keeps) in DeepSeek-V3's model.

A random model built by transformers (tests/hf_models.py: each query keeps the indexer's best 6
tokens) imports, gives float32 logits within 1e-5 relative over 40 tokens (the same weights attending
densely do not: the indexer's choice is what is compared), decodes greedily to transformers' own
tokens (a batch of prompts of different lengths equal to each alone), exports so that transformers
loads a DeepseekV32ForCausalLM with the same logits, and goes import → SFT from the written
recipe.yml → chat → export with transformers answering as maxlite does."""

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from maxlite.bridge import hf
from tests import hf_models
from tests.helpers import (assert_greedy_like_transformers, assert_import_sft_chat_export, imported_random_model,
                           jax_logits, relative, torch_logits)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 256




@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the transformers model, its directory, maxlite's import of it)."""
    return imported_random_model(tmp_path_factory, "deepseek_v32", ["max_target_length=64"])


def test_import_gives_transformers_logits_through_the_indexers_choice(imported):
    from maxlite.models.layout import layer_kinds

    model, _, cfg, pure = imported
    assert cfg.decoder_block == "deepseek_v32" and (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (6, 16, 16)
    assert [(k.mixer, k.ffn) for k in layer_kinds(cfg)] == [("dsa", "dense"), ("dsa", "moe"), ("dsa", "moe")]
    ids = np.random.default_rng(1).integers(0, V, (2, 40))
    theirs = torch_logits(model, ids)
    assert relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5
    # every earlier token kept (what latent attention alone computes) is another model
    assert relative(jax_logits(dataclasses.replace(cfg, index_topk=64), pure, ids), theirs) > 1e-2


def test_greedy_decoding_equals_transformers_and_a_batch_equals_each_alone(imported):
    """32 new tokens from batched prompts of different lengths (right-padded), each step's indexer
    choosing among the cached keys; each prompt alone decodes the same."""
    model, _, cfg, pure = imported
    assert_greedy_like_transformers(cfg, pure, model, 32, [list(range(100, 120)), [7, 8, 9]], alone=True)


def test_export_loads_in_transformers_with_the_same_logits(imported):
    model, path, cfg, pure = imported
    hf.export_hf(cfg, pure, str(path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    assert back.config.layer_types == model.config.layer_types
    assert (back.config.index_topk, back.config.index_n_heads, back.config.index_head_dim) == (6, 16, 16)
    ids = np.random.default_rng(2).integers(0, V, (1, 40))
    assert relative(torch_logits(back, ids), torch_logits(model, ids)) <= 1e-6


def test_import_sft_from_the_recipe_chat_export_and_transformers_answers_alike(tmp_path):
    """The journey as a user runs it for a random DeepSeek-V3.2: `hf import` → SFT from the written recipe.yml
    → `generate --chat` → `hf export` → transformers' greedy answer is ours (tests/helpers.py)."""
    assert_import_sft_chat_export(tmp_path, hf_models.config("deepseek_v32"), "DeepseekV32ForCausalLM")


def test_training_sends_the_indexers_loss_to_the_indexer_alone():
    """The gradient a training step gives the indexer's parameters is that of Σ_t KL(target_t ‖
    softmax(the indexer's scores of t's chosen keys)), the target the heads' attention over them
    (summed, normalised); the other parameters' gradients are the language model's alone (the same as
    with the indexer's loss left out)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import config as C
    from maxlite.models import dsa as dsa_lib
    from tests.helpers import shrunk

    cfg = C.load(shrunk("deepseek-v3.2") + ["dtype=float32"])
    with nnx.use_eager_sharding(False):  # no mesh: the parameters' logical axes unused
        layer = dsa_lib.DSA(cfg, rngs=nnx.Rngs(0))
    B, T = 2, 24
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.base_emb_dim))
    positions, segments = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32).at[1, 15:].set(2)
    probe = jax.random.normal(jax.random.key(2), (B, T, cfg.base_emb_dim))
    graphdef, params = nnx.split(layer, nnx.Param)

    def objective(params):  # a language model's loss stands in: any function of the layer's output
        return jnp.sum(nnx.merge(graphdef, params)(x, positions, segments) * probe)

    def indexer_kl(params):  # the indexer's loss written out, from the same choice and attention
        m = nnx.merge(graphdef, params)
        c, k_rope = m.latent(x, positions)
        visible = (jnp.arange(T)[:, None] >= jnp.arange(T)[None, :])[None] & (segments[:, :, None] == segments[:, None, :])
        q_nope, q_rope = m.queries(x, positions)
        q_i, w_i = m.index_queries(x, positions)
        index, valid, logits = m.choose(q_i, w_i, m.index_keys(x, positions), visible)
        _, probs = m.attend_chosen(q_nope, q_rope, c, k_rope, index, valid)
        target = jax.lax.stop_gradient(jnp.sum(probs, axis=2) * valid)
        target = target / jnp.sum(target, axis=-1, keepdims=True)
        log_p = jax.nn.log_softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
        return jnp.sum(jnp.where(valid, target * (jnp.log(jnp.where(valid, target, 1.0)) - log_p), 0.0))

    got = nnx.to_pure_dict(jax.grad(objective)(params))
    kl = nnx.to_pure_dict(jax.grad(indexer_kl)(params))
    original = dsa_lib.with_indexer_loss
    try:
        dsa_lib.with_indexer_loss = lambda out, *_: out  # the language model's gradient alone
        lm = nnx.to_pure_dict(jax.grad(objective)(params))
    finally:
        dsa_lib.with_indexer_loss = original
    indexer = ("index_q", "index_k", "index_norm", "index_w")
    for name in indexer:
        for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(kl[name])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        assert all(np.any(a != 0) for a in jax.tree.leaves(got[name])), name
        assert all(not np.any(a) for a in jax.tree.leaves(lm[name])), name  # the language model's loss leaves it
    for name in set(got) - set(indexer):
        for a, b in zip(jax.tree.leaves(got[name]), jax.tree.leaves(lm[name])):
            np.testing.assert_array_equal(a, b)


def test_the_dense_warmup_attends_every_earlier_token_and_its_indexer_learns_all_of_them():
    """index_stage=dense_warmup: the layer's output and every gradient (the indexer's loss included,
    now over every visible key) are those of the sparse stage keeping every earlier token
    (index_topk ≥ the length), over two packed documents; and not the sparse stage's 8 of 24."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import config as C
    from maxlite.models import dsa as dsa_lib
    from tests.helpers import shrunk

    B, T = 2, 24
    base = shrunk("deepseek-v3.2") + ["dtype=float32"]
    x = jax.random.normal(jax.random.key(1), (B, T, C.load(base).base_emb_dim))
    positions = jnp.concatenate([jnp.arange(T)[None], jnp.concatenate([jnp.arange(15), jnp.arange(9)])[None]])
    segments = jnp.ones((B, T), jnp.int32).at[1, 15:].set(2)
    probe = jax.random.normal(jax.random.key(2), x.shape)

    def run(extra):
        with nnx.use_eager_sharding(False):
            layer = dsa_lib.DSA(C.load(base + extra), rngs=nnx.Rngs(0))  # the same parameters each time
        graphdef, params = nnx.split(layer, nnx.Param)

        def objective(params):
            out = nnx.merge(graphdef, params)(x, positions, segments)
            return jnp.sum(out * probe), out
        (_, out), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return out, nnx.to_pure_dict(grads)

    warm, warm_grads = run(["index_stage=dense_warmup"])
    every, every_grads = run([f"index_topk={T}"])
    chosen, _ = run([])
    assert C.load(base).index_topk == 8
    np.testing.assert_allclose(warm, every, rtol=1e-5, atol=1e-6)
    assert relative(np.asarray(chosen), np.asarray(warm)) > 1e-2
    assert set(warm_grads) >= set(dsa_lib.INDEXER)
    for a, b in zip(jax.tree.leaves(warm_grads), jax.tree.leaves(every_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert all(np.any(a != 0) for name in dsa_lib.INDEXER for a in jax.tree.leaves(warm_grads[name]))


def test_a_dense_warmup_step_trains_the_indexers_and_nothing_else():
    """Training steps of the whole model (deepseek-v3.2 shrunk: two dsa layers, DeepSeekMoE with its
    routing bias, multi-token prediction) under index_stage=dense_warmup: every indexer parameter
    moves, every other parameter keeps its bytes (the routing biases too), and the optimizer holds
    state for the indexers only."""
    import jax

    from maxlite.models.dsa import INDEXER
    from maxlite.state import split_trainable
    from tests.helpers import build, shrunk

    from flax import nnx
    from maxlite import mesh as mesh_lib
    from maxlite.data.synthetic import make_synthetic_iterator

    cfg, mesh, state, step, sharding = build(shrunk("deepseek-v3.2") + ["index_stage=dense_warmup"], 1)
    before = jax.device_get(nnx.to_pure_dict(state.params))
    trainable, _ = split_trainable(state.params)
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(trainable))}
    assert names and all(any(f"'{n}'" in name for n in INDEXER) for name in names)
    data = make_synthetic_iterator(cfg, "train", 0, 1)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mesh_lib.RULES):
        for _ in range(2):  # the first step's learning rate is the warm-up's 0
            state, metrics = step(state, {k: jax.device_put(v, sharding) for k, v in next(data).items()})
    assert np.isfinite(float(metrics["loss"])) and float(metrics["learning_rate"]) > 0
    after = jax.device_get(nnx.to_pure_dict(state.params))
    moved = {jax.tree_util.keystr(p) for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(before),
                                                         jax.tree.leaves(after)) if np.any(a != b)}
    assert moved == names
    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    assert sum(np.size(x) for x in opt_leaves) == 2 * sum(np.size(x) for x in jax.tree.leaves(trainable))


def test_a_long_sequence_in_query_blocks_computes_what_one_block_does(monkeypatch):
    """Queries in blocks (dsa.QUERY_BLOCK: a 128k sequence's indexer scores never whole), each block's
    work recomputed in the backward pass: the same outputs and gradients as all queries at once, over
    two packed documents."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from maxlite import config as C
    from maxlite.models import dsa as dsa_lib
    from tests.helpers import shrunk

    cfg = C.load(shrunk("deepseek-v3.2") + ["dtype=float32"])
    with nnx.use_eager_sharding(False):
        layer = dsa_lib.DSA(cfg, rngs=nnx.Rngs(0))
    B, T = 2, 24
    x = jax.random.normal(jax.random.key(1), (B, T, cfg.base_emb_dim))
    positions = jnp.concatenate([jnp.arange(T)[None], jnp.concatenate([jnp.arange(15), jnp.arange(9)])[None]])
    segments = jnp.ones((B, T), jnp.int32).at[1, 15:].set(2)
    probe = jax.random.normal(jax.random.key(2), (B, T, cfg.base_emb_dim))
    graphdef, params = nnx.split(layer, nnx.Param)

    def run(params):
        out = nnx.merge(graphdef, params)(x, positions, segments)
        return jnp.sum(out * probe), out

    (_, whole), whole_grads = jax.value_and_grad(run, has_aux=True)(params)
    monkeypatch.setattr(dsa_lib, "QUERY_BLOCK", 8)  # three blocks of 8 queries
    (_, blocked), blocked_grads = jax.value_and_grad(run, has_aux=True)(params)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(blocked_grads), jax.tree.leaves(whole_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_published_checkpoints_prediction_layer_is_left_out_in_one_line(imported, tmp_path, capsys):
    """DeepSeek publishes its multi-token-prediction layer as layer num_hidden_layers (transformers'
    DeepseekV32ForCausalLM holds none): the import leaves those tensors out, says so in one line, and
    gives the same model."""
    import shutil

    from safetensors.numpy import load_file, save_file

    model, path, cfg, pure = imported
    shutil.copytree(path / "hf", tmp_path / "hf")
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    L = model.config.num_hidden_layers
    for name in ("eh_proj.weight", "enorm.weight", "self_attn.indexer.wk.weight", "mlp.experts.0.up_proj.weight"):
        tensors[f"model.layers.{L}.{name}"] = np.ones((4, 4), np.float32)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with_mtp, again = hf.import_hf(str(tmp_path / "hf"), ["max_target_length=64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "multi-token-prediction" in line] == [
        f"maxlite: 4 tensors of DeepSeek-V3.2's multi-token-prediction layer (model.layers.{L}+) are not imported: "
        "maxlite's model predicts the next token only"]
    ids = np.random.default_rng(3).integers(0, V, (1, 24))
    np.testing.assert_array_equal(jax_logits(with_mtp, again, ids), jax_logits(cfg, pure, ids))
