"""Qwen3.5 (dense and MoE) and Qwen3-Next: gated delta-net layers beside gated full attention.

Random models built by transformers (tests/hf_models.py; their reference PyTorch delta rule, chunks of
64, is the ground truth) import, give float32 logits within 1e-5 relative over prompts of several
chunks (150 tokens: not a multiple of the chunk), decode greedily to transformers' own tokens, export
so that transformers loads them with the same logits, and keep their tokenizer and chat template. The
chunked form is the token-by-token recurrence whatever the chunk size, and a packed row equals its
documents run one by one."""

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
from tests.helpers import jax_logits
from tests.hf_models import HYBRID_TWO

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 256
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}<think>\n\n"
            "</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}")
KINDS = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe"]  # tests/hf_models.py
BLOCK = {"qwen3_5_text": "qwen3_5", "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe"}


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.fixture(scope="module", params=KINDS)
def imported(request, tmp_path_factory):
    """(model type, the transformers model, its directory, maxlite's import of it)."""
    kind, path = request.param, tmp_path_factory.mktemp(request.param)
    model = hf_models.model(kind)
    model.save_pretrained(str(path / "hf"))
    tok = _tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(path / "hf"))
    cfg, pure = hf.import_hf(str(path / "hf"), ["max_target_length=160"])
    return kind, model, path, cfg, pure


def _tokenizer():
    """A word-level tokenizer of V ids built here (no download), with Qwen's chat markers."""
    import tokenizers

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"] + [f"w{i}" for i in range(V - 5)]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                                additional_special_tokens=words[1:5])


def test_import_gives_transformers_logits_over_several_chunks(imported):
    kind, model, _, cfg, pure = imported
    assert cfg.decoder_block == BLOCK[kind] and cfg.partial_rotary_factor == 0.25
    assert list(cfg.layer_types) == ([] if kind == "qwen3_5_text" else HYBRID_TWO["layer_types"])  # own pattern kept
    ids = np.random.default_rng(1).integers(0, V, (2, 150))
    assert _relative(jax_logits(cfg, pure, ids), _logits(model, ids)) <= 1e-5


def test_greedy_decoding_from_the_state_equals_transformers(imported):
    """256 new tokens from batched prompts of different lengths (right-padded: the padding must leave
    the state and the convolution window alone), decoded from the recurrent state and KV cache."""
    kind, model, _, cfg, pure = imported
    prompts = [list(range(100, 170)), [7, 8, 9]]
    new = 256 if kind == "qwen3_5_text" else 64  # the MoE layers repeat what the dense one proves
    ours = generate_ids(cfg, P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure))), prompts,
                        Sampling(max_new_tokens=new)).tokens
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                 eos_token_id=None, pad_token_id=0)
        assert got == out[0, len(prompt):].tolist()
        assert len(set(got)) > 8, got  # a varied path, not one token repeated


def test_export_loads_in_transformers_with_the_same_logits_and_tokenizer(imported):
    kind, model, path, cfg, pure = imported
    hf.export_hf(cfg, pure, str(path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    assert back.config.layer_types == model.config.layer_types
    ids = np.random.default_rng(2).integers(0, V, (1, 70))
    assert _relative(_logits(back, ids), _logits(model, ids)) <= 1e-6
    chat = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]
    mine, again = (transformers.AutoTokenizer.from_pretrained(str(path / d)) for d in ("hf", "back"))
    assert again.apply_chat_template(chat, tokenize=False) == mine.apply_chat_template(chat, tokenize=False)
    assert "<think>\n\n</think>" in again.apply_chat_template(chat, tokenize=False)


HYBRID = ["base.yml", "model_name=tiny-hybrid", "base_emb_dim=64", "base_mlp_dim=96", "base_num_query_heads=4",
          "base_num_kv_heads=2", "head_dim=16", "gdn_num_key_heads=2", "gdn_num_value_heads=4",
          "gdn_key_head_dim=16", "gdn_value_head_dim=16", "vocab_size=256", "dtype=float32",
          "max_target_length=64", "partial_rotary_factor=0.25"]


def test_a_packed_row_equals_its_documents_run_one_by_one():
    """Three documents in one row (cut mid-chunk) and each alone in a row of its own (right-padded,
    one batch): neither the state nor the convolution's window carries from one document into the
    next."""
    from flax import nnx

    from maxlite.state import abstract_params

    cfg = C.load([*HYBRID, "gdn_chunk_size=16"])
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
        assert _relative(logits[0, a:b], logits[row, :b - a]) <= 1e-5


def _recurrent(q, k, v, g, beta, seg):
    """The gated delta rule token by token in float64 (transformers' recurrent form), the state reset
    where the segment changes."""
    B, T, M, E = q.shape
    S, out = np.zeros((B, M, E, v.shape[-1])), np.zeros(v.shape)
    for t in range(T):
        keep = (seg[:, t] == seg[:, t - 1]) if t else np.zeros(B, bool)
        S = S * (np.exp(g[:, t]) * keep[:, None])[..., None, None]
        delta = (v[:, t] - np.einsum("bmeu,bme->bmu", S, k[:, t])) * beta[:, t, :, None]
        S = S + np.einsum("bme,bmu->bmeu", k[:, t], delta)
        out[:, t] = np.einsum("bmeu,bme->bmu", S, q[:, t])
    return out, S


def test_the_chunked_form_is_the_recurrence_for_any_chunk_size():
    """Against the token-by-token recurrence in float64, over packed rows: the chunk size (one that
    divides nothing included) changes nothing beyond float32 rounding."""
    from maxlite.models.gated_deltanet import chunked_delta_rule

    rng = np.random.default_rng(0)
    B, T, M, E, U = 2, 90, 2, 16, 8
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in rng.standard_normal((2, B, T, M, E)))
    q = q * E ** -0.5
    v = rng.standard_normal((B, T, M, U))
    g, beta = -0.3 * np.abs(rng.standard_normal((B, T, M))), 1 / (1 + np.exp(-rng.standard_normal((B, T, M))))
    seg = np.stack([np.ones(T), np.repeat([1, 2, 3], [40, 25, 25])]).astype(np.int32)
    want, want_S = _recurrent(q, k, v, g, beta, seg)
    for chunk in (64, 7):
        got, S = jax.jit(chunked_delta_rule, static_argnames="chunk")(
            *(x.astype(np.float32) for x in (q, k, v, g, beta)), seg, chunk=chunk)
        assert _relative(np.asarray(got), want) <= 1e-5 and _relative(np.asarray(S), want_S) <= 1e-5


def test_context_parallelism_is_refused_in_one_line():
    cfg = C.load([*HYBRID, "ici_context_parallelism=2"])
    with pytest.raises(C.ConfigError, match="does not split gated delta-net layers") as e:
        C.resolve(cfg, 2)
    assert "\n" not in str(e.value)


def test_the_decode_state_is_the_same_size_at_any_context():
    """Per sequence: the delta-net layers keep a state and a window whatever the length; only the
    full-attention layer's K/V grows (one layer of four)."""
    from maxlite.models.kinds import cache_numbers_per_token

    cfg = C.load(HYBRID)
    K, H = cfg.base_num_kv_heads, cfg.head_dim
    state = cfg.gdn_num_value_heads * cfg.gdn_key_head_dim * cfg.gdn_value_head_dim
    window = 3 * (2 * cfg.gdn_num_key_heads * cfg.gdn_key_head_dim + cfg.gdn_num_value_heads * cfg.gdn_value_head_dim)
    for length in (1024, 32768):
        assert cache_numbers_per_token(cfg, length) * length == 3 * (state + window) + 2 * length * K * H


def test_the_flop_count_is_the_layers_projections_and_a_chunked_rule_linear_in_length():
    """The delta-net layers' projections count 2 FLOPs per weight per token (their weights read off
    the model), and their rule grows linearly with the sequence where the attention layer's grows
    quadratically."""
    from maxlite.bridge.params import layer_leaf
    from maxlite.models.kinds import MIXERS

    cfg = C.load(HYBRID)
    pure = P.random_params(cfg)
    weights = sum(layer_leaf(pure, cfg, 0, ("attn", name)).size for name in
                  ("q", "k", "v", "z", "b", "a", "o", "conv_q", "conv_k", "conv_v"))
    B, T = 2, 256
    gdn = MIXERS["gated_deltanet"].flops(cfg, B, T, "linear")
    assert gdn["qkv"] + gdn["out"] == 2 * B * T * weights
    assert MIXERS["gated_deltanet"].flops(cfg, B, 4 * T, "linear")["attention"] == 4 * gdn["attention"]
    full = MIXERS["attention"].flops(cfg, B, T, "global")["attention"]
    assert MIXERS["attention"].flops(cfg, B, 4 * T, "global")["attention"] == 16 * full


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_a_multimodal_checkpoint_imports_its_text_model(kind, tmp_path):
    """The published Qwen3.5 checkpoints are Qwen3_5[Moe]ForConditionalGeneration: config.json nests
    text_config (here without mrope_section: transformers' default [11, 11, 10] on 2 turned
    frequencies), the decoder's tensors sit under model.language_model. beside the vision tower
    (imported too: tests/test_qwen3_5_vision.py); text tokens give the full model's logits."""
    text = hf_models.config("qwen3_5_text" if kind == "qwen3_5" else "qwen3_5_moe").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=2, num_position_embeddings=16)
    make = transformers.Qwen3_5Config if kind == "qwen3_5" else transformers.Qwen3_5MoeConfig
    torch.manual_seed(0)
    full = transformers.AutoModelForImageTextToText.from_config(make(text_config=text, vision_config=vision)).eval()
    full.save_pretrained(str(tmp_path / "mm"))
    cfg, pure = hf.import_hf(str(tmp_path / "mm"))
    assert cfg.decoder_block == ("qwen3_5" if kind == "qwen3_5" else "qwen3_5_moe")
    ids = np.random.default_rng(3).integers(0, V, (1, 80))  # text tokens only
    with torch.no_grad():
        theirs = full(input_ids=torch.tensor(ids)).logits.float().numpy()
    assert _relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5


def test_lora_adapters_of_a_hybrid_fold_into_its_weights():
    """LoRA on the attention layers' and the MLPs' projections (the delta-net layers have none):
    what `hf export` writes, the adapters merged, computes what the model with adapters computes."""
    import dataclasses

    from maxlite.models import lora

    cfg = C.load([*HYBRID, "lora_rank=2", "lora_targets=[q_proj, o_proj, down_proj]"])
    pure = P.random_params(cfg, seed=3, std=0.1)  # B random, not zero: the adapters count
    ids = np.random.default_rng(4).integers(0, V, (1, 40))
    base = dataclasses.replace(cfg, lora_rank=0)
    assert _relative(jax_logits(base, lora.merged(cfg, pure), ids), jax_logits(cfg, pure, ids)) <= 1e-5
