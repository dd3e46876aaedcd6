"""Kimi Linear: Kimi delta attention (the `kda` mixer kind, a gated delta rule with per-channel decay)
beside NoPE latent attention, a dense first layer then DeepSeekMoE.

A random model built by transformers (tests/hf_models.py; its reference PyTorch KDA, chunks of 64,
is the ground truth) imports, gives float32 logits within 1e-5 relative over prompts of several
chunks, decodes greedily to transformers' own tokens (a batch of prompts of different lengths equal
to each alone), and exports so that transformers loads a KimiLinearForCausalLM with the same logits.
The chunked per-channel form is the token-by-token recurrence (NumPy, float64) whatever the chunk
size, packed rows included; the KDA layers' decode state is the same size at any length."""

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
from tests.helpers import (assert_greedy_like_transformers, assert_import_sft_chat_export, imported_random_model,
                           jax_logits, relative, torch_logits)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 256




@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the transformers model, its directory, maxlite's import of it)."""
    return imported_random_model(tmp_path_factory, "kimi_linear", ["max_target_length=160"])


def test_import_gives_transformers_logits_over_several_chunks(imported):
    model, _, cfg, pure = imported
    assert cfg.decoder_block == "kimi_linear" and cfg.attention_type == "mla"
    from maxlite.models.layout import layer_kinds
    assert [(k.mixer, k.ffn) for k in layer_kinds(cfg)] == [("kda", "dense"), ("mla", "moe"), ("kda", "moe"),
                                                            ("kda", "moe")]
    ids = np.random.default_rng(1).integers(0, V, (2, 150))  # 150: three chunks of 64, the last cut
    assert relative(jax_logits(cfg, pure, ids), torch_logits(model, ids)) <= 1e-5


def test_greedy_decoding_equals_transformers_and_a_batch_equals_each_alone(imported):
    """32 new tokens from batched prompts of different lengths (right-padded: the padding must leave
    the state and the convolution window alone), decoded from the recurrent state and the latent
    cache; each prompt alone decodes the same."""
    model, _, cfg, pure = imported
    assert_greedy_like_transformers(cfg, pure, model, 32, [list(range(100, 170)), [7, 8, 9]], alone=True)


def test_export_loads_in_transformers_with_the_same_logits(imported):
    model, path, cfg, pure = imported
    hf.export_hf(cfg, pure, str(path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    assert back.config.layer_types == model.config.layer_types
    assert back.config.mlp_layer_types == model.config.mlp_layer_types
    ids = np.random.default_rng(2).integers(0, V, (1, 70))
    assert relative(torch_logits(back, ids), torch_logits(model, ids)) <= 1e-6


def test_the_decode_state_of_the_kda_layers_is_the_same_size_at_any_length(imported):
    """What `generate` reports: the KDA layers' state and windows as a state of fixed bytes per sequence,
    the same at two lengths; the rest of the cache, the latent attention layer's C + R numbers per
    token, is what grows."""
    from maxlite.generate import cache_line
    from maxlite.models.kinds import MIXERS

    _, _, cfg, pure = imported
    params = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    H, E = cfg.gdn_num_value_heads, cfg.gdn_key_head_dim
    kda = H * E * E + (cfg.gdn_conv_kernel_dim - 1) * 3 * H * E  # float32: one number each
    assert MIXERS["kda"].cache_numbers(cfg, "linear", 40) == MIXERS["kda"].cache_numbers(cfg, "linear", 1 << 20) == kda
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    for new in (4, 36):
        got = generate_ids(cfg, params, [[5, 6, 7, 8]], Sampling(max_new_tokens=new))
        assert got.cache_positions == 4 + new
        assert got.cache_state_bytes == 4 * 3 * kda  # three KDA layers
        assert got.cache_bytes_per_token * got.cache_positions == pytest.approx(4 * (3 * kda + (4 + new) * latent))
        assert cache_line(got) == (f"decode cache {4 * latent:,} bytes per token + a recurrent state of "
                                   f"{4 * 3 * kda:,} bytes per sequence at any length")


def _recurrent(q, k, v, g, beta, seg):
    """Kimi delta attention token by token in float64 (transformers' recurrent form: the state's key
    rows decayed each by its own exp(g)), the state reset where the segment changes."""
    B, T, M, E = q.shape
    S, out = np.zeros((B, M, E, v.shape[-1])), np.zeros(v.shape)
    for t in range(T):
        keep = (seg[:, t] == seg[:, t - 1]) if t else np.zeros(B, bool)
        S = S * (np.exp(g[:, t]) * keep[:, None, None])[..., None]
        delta = (v[:, t] - np.einsum("bmeu,bme->bmu", S, k[:, t])) * beta[:, t, :, None]
        S = S + np.einsum("bme,bmu->bmeu", k[:, t], delta)
        out[:, t] = np.einsum("bmeu,bme->bmu", S, q[:, t])
    return out, S


def test_the_per_channel_chunked_form_is_the_recurrence_for_any_chunk_size():
    """Against the recurrence in float64, over packed rows, decays of every size per key dim: the
    chunk size (one that divides nothing included) changes nothing beyond float32 rounding."""
    from maxlite.models.gated_deltanet import chunked_delta_rule

    rng = np.random.default_rng(0)
    B, T, M, E, U = 2, 90, 2, 16, 8
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in rng.standard_normal((2, B, T, M, E)))
    q = q * E ** -0.5
    v = rng.standard_normal((B, T, M, U))
    g = -np.exp(rng.uniform(-6, 1, (B, T, M, E)))  # per channel: from ~0 to a decay of e^-2.7 a token
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, M))))
    seg = np.stack([np.ones(T), np.repeat([1, 2, 3], [40, 25, 25])]).astype(np.int32)
    want, want_S = _recurrent(q, k, v, g, beta, seg)
    for chunk in (64, 7):
        got, S = jax.jit(chunked_delta_rule, static_argnames="chunk")(
            *(x.astype(np.float32) for x in (q, k, v, g, beta)), seg, chunk=chunk)
        assert relative(np.asarray(got), want) <= 1e-5 and relative(np.asarray(S), want_S) <= 1e-5


KIMI = ["base.yml", "decoder_block=kimi_linear", "attention_type=mla",
        "base_emb_dim=64", "base_mlp_dim=96", "base_num_query_heads=4", "base_num_kv_heads=4",
        "q_lora_rank=0", "kv_lora_rank=16", "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8",
        "gdn_num_key_heads=2", "gdn_num_value_heads=2", "gdn_key_head_dim=16", "gdn_value_head_dim=16",
        "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=16", "shared_experts=1",
        "first_num_dense_layers=0", "routed_score_func=sigmoid", "routed_bias=true", "vocab_size=256",
        "dtype=float32", "max_target_length=64", "base_num_decoder_layers=4"]


def test_unequal_key_and_value_heads_are_refused_in_one_line():
    with pytest.raises(C.ConfigError, match="Kimi delta attention has one head shape") as e:
        C.load([*KIMI, "gdn_num_value_heads=4"])
    assert "\n" not in str(e.value)


def test_a_packed_row_equals_its_documents_run_one_by_one():
    """Three documents in one row (cut mid-chunk) and each alone in a row of its own: neither the KDA
    state nor the convolution's window carries from one document into the next."""
    from flax import nnx

    from maxlite.state import abstract_params

    cfg = C.load([*KIMI, "gdn_chunk_size=16"])
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


def test_the_flop_count_is_the_layers_projections_and_a_chunked_rule_linear_in_length():
    """The KDA layers' projections (the low-rank gates and the convolution included) count 2 FLOPs
    per weight per token, their weights read off the model; their rule grows linearly with length."""
    from maxlite.bridge.params import layer_leaf
    from maxlite.models.kinds import MIXERS

    cfg = C.load(KIMI)
    pure = P.random_params(cfg)
    weights = sum(layer_leaf(pure, cfg, 0, ("attn", name)).size for name in
                  ("q", "k", "v", "f_a", "f_b", "g_a", "g_b", "b", "o", "conv_q", "conv_k", "conv_v"))
    B, T = 2, 256
    kda = MIXERS["kda"].flops(cfg, B, T, "linear")
    assert kda["qkv"] + kda["out"] == 2 * B * T * weights
    assert MIXERS["kda"].flops(cfg, B, 4 * T, "linear")["attention"] == 4 * kda["attention"]


def test_lora_adapters_of_the_kda_layers_fold_into_their_weights():
    """LoRA on Kimi's q/k/v/o_proj (the KDA layers' and the latent attention's q_proj, o_proj): what
    `hf export` writes, the adapters merged, computes what the model with adapters computes."""
    import dataclasses

    from maxlite.models import lora

    cfg = C.load([*KIMI, "lora_rank=2", "lora_targets=[q_proj, k_proj, v_proj, o_proj]"])
    pure = P.random_params(cfg, seed=3, std=0.1)  # B random, not zero: the adapters count
    assert "q_lora_b" in pure["layers"]["blocks"][0]["attn"] and "k_lora_b" in pure["layers"]["blocks"][0]["attn"]
    ids = np.random.default_rng(4).integers(0, V, (1, 40))
    base = dataclasses.replace(cfg, lora_rank=0)
    assert relative(jax_logits(base, lora.merged(cfg, pure), ids), jax_logits(cfg, pure, ids)) <= 1e-5




def test_import_sft_from_the_recipe_chat_export_and_transformers_answers_alike(tmp_path):
    """The journey as a user runs it for a random Kimi Linear: `hf import` → SFT from the written recipe.yml
    → `generate --chat` → `hf export` → transformers' greedy answer is ours (tests/helpers.py)."""
    assert_import_sft_chat_export(tmp_path, hf_models.config("kimi_linear"), "KimiLinearForCausalLM")