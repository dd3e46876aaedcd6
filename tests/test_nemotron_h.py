"""Nemotron-H: Mamba-2 layers (maxlite/models/mamba2.py), attention without positions and squared-ReLU
MLPs, each a block of its own (the `none` kinds fill the other half of a layer).

A random model built by transformers (tests/hf_models.py: Mamba-2, attention, MLP, Mamba-2; its
PyTorch scan, chunks of 8, is the ground truth) imports, gives float32 logits within 1e-5 relative
over prompts of several chunks, decodes greedily to transformers' own 32 tokens from the fixed state
(batched as one at a time), and exports back to NemotronHForCausalLM with the same logits. The chunked
scan is the token-by-token recurrence (NumPy, float64) whatever the chunk size, a packed row equals
its documents run one by one, and the decode state is the same size at any context."""

import jax
import numpy as np
import pytest
import torch
import transformers

from maxlite import config as C
from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.generate import Sampling, generate_ids
from tests import hf_models
from tests.helpers import imported_random_model, jax_logits, relative, torch_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 256
TINY = ["base.yml", "decoder_block=nemotron_h", "base_emb_dim=64", "base_mlp_dim=96", "base_num_query_heads=4",
        "base_num_kv_heads=2", "head_dim=16", "mamba_num_heads=8", "mamba_head_dim=8", "mamba_state_dim=16",
        "mamba_num_groups=2", "vocab_size=256", "dtype=float32", "max_target_length=64", "base_num_decoder_layers=4",
        "layer_types=[mamba,full_attention,mlp,mamba]"]




@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the transformers model, its directory, maxlite's import of it)."""
    return imported_random_model(tmp_path_factory, "nemotron_h", ["dtype=float32", "max_target_length=128"])


def test_import_gives_transformers_logits_over_several_chunks(imported):
    model, _, cfg, pure = imported
    assert cfg.decoder_block == "nemotron_h" and list(cfg.layer_types) == ["mamba", "full_attention", "mlp", "mamba"]
    assert cfg.mamba_chunk_size == 8
    ids = np.random.default_rng(1).integers(0, V, (2, 43))  # 6 chunks, the last cut
    assert relative(jax_logits(cfg, pure, ids), torch_logits(model, ids)) <= 1e-5


def test_greedy_decoding_from_the_state_equals_transformers_and_one_at_a_time(imported):
    """32 new tokens from batched prompts of different lengths (right-padded: the padding must leave
    the state and the convolution window alone), each as transformers' generate gives it, and as
    maxlite gives it for the prompt alone."""
    model, _, cfg, pure = imported
    params = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    prompts = [list(range(100, 130)), [7, 8, 9], list(range(40, 51))]
    ours = generate_ids(cfg, params, prompts, Sampling(max_new_tokens=32)).tokens
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32,
                                 eos_token_id=None, pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()
        assert len(set(got)) > 6, got  # a varied path, not one token repeated
        assert generate_ids(cfg, params, [prompt], Sampling(max_new_tokens=32)).tokens == [got]


def test_export_loads_in_transformers_with_the_same_logits(imported):
    model, path, cfg, pure = imported
    hf.export_hf(cfg, pure, str(path / "back"), tokenizer="none")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "back"), dtype=torch.float32)
    assert type(back) is transformers.NemotronHForCausalLM
    assert back.config.layers_block_type == model.config.layers_block_type
    ids = np.random.default_rng(2).integers(0, V, (1, 40))
    assert relative(torch_logits(back, ids), torch_logits(model, ids)) <= 1e-6


def test_the_decode_state_is_the_same_size_at_any_context(imported):
    """generate's recurrent state per sequence: the two Mamba-2 layers' state and windows, the arrays the
    decode loop allocates for them, the same at two lengths; the attention layer's K/V is the cache
    per token beside it."""
    from maxlite.models.decode import empty_cache

    model, _, cfg, pure = imported
    params = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    kv = 2 * cfg.base_num_kv_heads * cfg.head_dim * 4  # bytes per position of the attention layer
    states = []
    for prompt, new in (([5, 6, 7], 8), ([5, 6, 7] * 10, 60)):
        got = generate_ids(cfg, params, [prompt], Sampling(max_new_tokens=new))
        length = len(prompt) + new
        assert got.cache_positions == length
        assert got.cache_bytes_per_token * length - got.cache_state_bytes == kv * length
        cache = jax.eval_shape(lambda: empty_cache(cfg, 1, length))
        arrays = cache.stacks[("mamba2", "mamba")][0]
        assert got.cache_state_bytes == sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(arrays))
        states.append(got.cache_state_bytes)
    assert states[0] == states[1] > 0


def _recurrent(x, dt, A, Bm, Cm, seg, h0):
    """The selective scan token by token in float64 (transformers' recurrent form), head m reading
    group m // (M/G), the state reset where the segment changes."""
    Bt, T, M, Pd = x.shape
    heads = M // Bm.shape[2]
    Bh, Ch = np.repeat(Bm, heads, axis=2), np.repeat(Cm, heads, axis=2)
    h, out = h0.astype(np.float64), np.zeros(x.shape)
    for t in range(T):
        keep = (seg[:, t] == seg[:, t - 1]) if t else np.ones(Bt, bool)
        h = h * keep[:, None, None, None] * np.exp(dt[:, t] * A)[..., None, None]
        h = h + np.einsum("bmp,bms->bmps", x[:, t] * dt[:, t, :, None], Bh[:, t])
        out[:, t] = np.einsum("bmps,bms->bmp", h, Ch[:, t])
    return out, h


def test_the_chunked_scan_is_the_recurrence_for_any_chunk_size():
    """Against the token-by-token recurrence in float64, over packed rows and from a nonzero entering
    state: the chunk size (one that divides nothing included) changes nothing beyond float32 rounding."""
    from maxlite.models.mamba2 import chunked_scan

    rng = np.random.default_rng(0)
    B, T, M, Pd, G, S = 2, 90, 4, 8, 2, 16
    x = rng.standard_normal((B, T, M, Pd))
    dt = np.log1p(np.exp(rng.standard_normal((B, T, M))))  # softplus
    A = -np.arange(1, M + 1) * 0.5
    Bm, Cm = rng.standard_normal((2, B, T, G, S)) * 0.5
    seg = np.stack([np.ones(T), np.repeat([1, 2, 3], [40, 25, 25])]).astype(np.int32)
    h0 = rng.standard_normal((B, M, Pd, S))
    want, want_h = _recurrent(x, dt, A, Bm, Cm, seg, h0)
    for chunk in (64, 7, 1):
        got, h = jax.jit(chunked_scan, static_argnames="chunk")(
            *(v.astype(np.float32) for v in (x, dt, A, Bm, Cm)), seg, h0.astype(np.float32), chunk=chunk)
        assert relative(np.asarray(got), want) <= 1e-5 and relative(np.asarray(h), want_h) <= 1e-5


def test_a_packed_row_equals_its_documents_run_one_by_one():
    """Three documents in one row (cut mid-chunk) and each alone in a row of its own (right-padded,
    one batch): neither the state nor the convolution's window carries from one document into the
    next (nor attention: segments)."""
    from flax import nnx

    from maxlite.state import abstract_params

    cfg = C.load([*TINY, "mamba_chunk_size=16"])
    pure = P.random_params(cfg, seed=1, std=0.1)
    lengths = [21, 30, 13]
    T, starts = sum(lengths), np.cumsum([0] + lengths)
    docs = [np.random.default_rng(i).integers(0, V, n) for i, n in enumerate(lengths)]
    ids, positions, segments = (np.zeros((4, T), np.int32) for _ in range(3))
    ids[0], segments[0] = np.concatenate(docs), np.repeat([1, 2, 3], lengths)
    positions[0] = np.concatenate([np.arange(n) for n in lengths])
    for row, doc in enumerate(docs, start=1):
        ids[row, :len(doc)], segments[row, :len(doc)], positions[row] = doc, 1, np.arange(T)
    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    logits = np.asarray(nnx.jit(lambda m, *a: m(*a))(nnx.merge(graphdef, state), ids, positions, segments))
    for row, (a, b) in enumerate(zip(starts[:-1], starts[1:]), start=1):
        assert relative(logits[0, a:b], logits[row, :b - a]) <= 1e-5


def test_a_block_is_a_mixer_or_an_mlp_never_both():
    """Each layer's parameters: one norm and its mixer, or one norm and the MLP (as HF's blocks)."""
    cfg = C.load(TINY)
    layers = P.random_params(cfg)["layers"]
    blocks = [layers["blocks"][j] for j in range(4)] if "blocks" in layers else [layers[j] for j in range(4)]
    assert [sorted(b) for b in blocks] == [["attn", "attn_norm"], ["attn", "attn_norm"], ["mlp", "mlp_norm"],
                                           ["attn", "attn_norm"]]


def test_context_parallelism_and_ungrouped_heads_are_refused_in_one_line():
    cfg = C.load([*TINY, "ici_context_parallelism=2"])
    with pytest.raises(C.ConfigError, match="does not split Mamba-2 layers") as e:
        C.resolve(cfg, 2)
    assert "\n" not in str(e.value)
    with pytest.raises(C.ConfigError, match="multiple of mamba_num_groups") as e:
        C.load([*TINY, "mamba_num_groups=3"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change, says", [
    (dict(layers_block_type=["linear_attention", "moe"]), "block type 'moe' is not modelled"),
    (dict(time_step_limit=[0.0, 0.5]), "does not clamp the time step"),
    (dict(mlp_hidden_act="gelu"), "mlp_hidden_act='gelu'"),
])
def test_what_maxlite_does_not_model_is_refused_at_import_in_one_line(change, says, tmp_path):
    import json

    hf_models.config("nemotron_h").save_pretrained(str(tmp_path))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises((ValueError, C.ConfigError), match=says) as e:
        hf.prepare_import(str(tmp_path))
    assert "\n" not in str(e.value)


def test_the_flop_count_is_the_layers_projections_and_a_scan_linear_in_length():
    """The Mamba-2 layer's projections and convolution count 2 FLOPs per weight per token (its weights
    read off the model), and its scan grows linearly with the sequence."""
    from maxlite.bridge.params import layer_leaf
    from maxlite.models.kinds import MIXERS

    cfg = C.load(TINY)
    pure = P.random_params(cfg)
    weights = sum(layer_leaf(pure, cfg, 0, ("attn", name)).size for name in
                  ("z", "x", "B", "C", "dt", "o", "conv_x", "conv_B", "conv_C"))
    B, T = 2, 256
    got = MIXERS["mamba2"].flops(cfg, B, T, "mamba")
    assert got["qkv"] + got["out"] == 2 * B * T * weights
    assert MIXERS["mamba2"].flops(cfg, B, 4 * T, "mamba")["attention"] == 4 * got["attention"]


def test_the_torch_twin_refuses_it_in_one_line():
    from maxlite.bridge import torch_model

    with pytest.raises(ValueError, match="does not model .*Mamba-2 layers") as e:
        torch_model.check_supported(C.load(TINY))
    assert "\n" not in str(e.value)
