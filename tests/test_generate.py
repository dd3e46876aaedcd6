"""Sampling with a KV cache (maxlite/models/decode.py, maxlite/generate.py): the cache decodes what
recomputing the whole prefix decodes, batched prompts of different lengths decode as they do alone,
greedy output equals transformers' `generate` on an imported HF model, and the CLI works on a run."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from maxlite import api, config as C
from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.generate import Sampling, generate_ids
from tests.helpers import SMALL
from tests.xla_flags import cpu_xla_flags

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 17, 200, 3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [250, 1, 2]]


def _model(*extra):
    cfg = C.load([*SMALL, "dtype=float32", "init_scale=0.5", *extra])  # large weights: no near-ties
    model = api.create_model(cfg, seed=3)
    return cfg, model, nnx.split(model, nnx.Param)[1]


def _recomputed_greedy(model, ids, n):
    """The reference: the whole prefix through the training forward pass for every new token (one
    compiled shape: the prefix padded at its end, which causal attention never lets it see)."""
    ids, length = list(ids), len(ids) + n
    for _ in range(n):
        logits = np.asarray(api.forward(model, np.array([ids + [0] * (length - len(ids))])))[0, len(ids) - 1]
        ids.append(int(np.argmax(logits)))
    return ids[-n:]


FAMILIES = {  # windows shorter than the prompts: the ring caches wrap during prefill and decoding
    "llama": [], "qwen2": ["decoder_block=qwen2", "use_bias=true"], "qwen3": ["decoder_block=qwen3"],
    "mistral-window": ["sliding_window=3"],
    "gemma3": ["decoder_block=gemma3", "sliding_window=4", "local_rope_max_timescale=100",
               "base_num_decoder_layers=7", "query_pre_attn_scalar=24"],
    # latent attention decodes from its latent (the up-projections absorbed), a window as a ring too
    "deepseek-mla": ["decoder_block=deepseek", "attention_type=mla", "q_lora_rank=24", "kv_lora_rank=16",
                     "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=12", "num_experts=4",
                     "num_experts_per_tok=2", "base_moe_mlp_dim=32", "shared_experts=1", "first_num_dense_layers=1",
                     "routed_score_func=sigmoid", "routed_bias=true"],
    "mla-window": ["attention_type=mla", "q_lora_rank=0", "kv_lora_rank=16", "qk_nope_head_dim=8",
                   "qk_rope_head_dim=8", "v_head_dim=12", "sliding_window=3"],
}


@pytest.mark.parametrize("family, scan", [("llama", "true"), ("llama", "false"), ("qwen2", "true"),
                                          ("qwen3", "true"), ("mistral-window", "true"), ("gemma3", "true"),
                                          ("gemma3", "false"), ("deepseek-mla", "true"), ("mla-window", "true")])
def test_cached_decoding_equals_recomputing_the_prefix_and_batching_changes_nothing(family, scan):
    cfg, model, params = _model(f"scan_layers={scan}", *FAMILIES[family])
    batched = generate_ids(cfg, params, PROMPTS, Sampling(max_new_tokens=8))
    assert batched.steps == 8
    for ids, got in zip(PROMPTS, batched.tokens):
        assert got == _recomputed_greedy(model, ids, 8)
        assert generate_ids(cfg, params, [ids], Sampling(max_new_tokens=8)).tokens == [got]  # alone


def test_sampling_controls():
    cfg, _, params = _model()
    greedy = generate_ids(cfg, params, PROMPTS, Sampling(max_new_tokens=12)).tokens
    assert generate_ids(cfg, params, PROMPTS, Sampling(12, temperature=1.0, top_k=1, seed=7)).tokens == greedy
    hot = Sampling(12, temperature=1.5, seed=1)
    first = generate_ids(cfg, params, PROMPTS, hot).tokens
    assert generate_ids(cfg, params, PROMPTS, hot).tokens == first  # same seed, same sample
    assert generate_ids(cfg, params, PROMPTS, Sampling(12, temperature=1.5, seed=2)).tokens != first
    assert first != greedy
    # a row stops at its end-of-text id; the others go on
    eos = greedy[0][3]
    stopped = generate_ids(cfg, params, PROMPTS, Sampling(max_new_tokens=12), eos_id=eos).tokens
    assert stopped[0] == greedy[0][:greedy[0].index(eos)]
    with pytest.raises(C.ConfigError, match="max_position_embeddings"):
        generate_ids(cfg, params, PROMPTS, Sampling(max_new_tokens=cfg.max_position_embeddings))


def test_a_draw_is_jaxs_own_argmax_and_categorical():
    """`sample` takes jnp.argmax's token and jax.random.categorical's draw by a faster route (a max,
    then the first index holding it): the same tokens for the same keys, one key for the batch or
    one per row; a tie goes to the first index, a row with a NaN to its first NaN, as argmax's do."""
    import jax.numpy as jnp

    from maxlite.models import decode

    logits = np.random.default_rng(0).standard_normal((16, 1000)).astype(np.float32)
    logits[1, [3, 700]] = 9.0
    logits[2, [5, 600]] = np.nan
    logits = jnp.asarray(logits)
    key = jax.random.key(3)
    greedy = decode.sample(logits, key, 0.0, 0, 1.0)[0]
    assert greedy.dtype == jnp.int32 and (greedy == jnp.argmax(logits, -1)).all() and greedy[1:3].tolist() == [3, 5]
    rows = jax.random.split(key, 16)
    assert (decode.sample(logits, key, 1.0, 0, 1.0)[0] == jax.random.categorical(key, logits, -1)).all()
    assert (decode.sample(logits, rows, 1.0, 0, 1.0)[0] == jax.vmap(jax.random.categorical)(rows, logits)).all()


def _word_tokenizer(directory, size):
    """An HF tokenizer of `size` whole-word ids (w0 ... w{size-2}, and <eos>), saved as transformers does."""
    import tokenizers
    vocab = {f"w{i}": i for i in range(size - 1)} | {"<eos>": size - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(directory))
    return tok


@pytest.mark.timeout(900)  # five CLI runs (import and generate, twice; a prompts file) of up to 300 s each
def test_greedy_equals_transformers_generate_on_an_imported_llama31(tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
        rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    tok = _word_tokenizer(tmp_path / "hf", 300)

    def theirs(ids, n=16):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 eos_token_id=None, pad_token_id=0)
        return out[0, len(ids):].tolist()

    # from Python: batched prompts of different lengths, token for token
    cfg, pure = hf.import_hf(str(tmp_path / "hf"))
    assert cfg.dtype == "float32"  # what config.json states
    params = P.to_state(cfg, P.to_jax_inplace(pure))
    prompts = [[11, 22, 33, 44, 55, 66], [7, 8, 9]]
    ours = generate_ids(cfg, params, prompts, Sampling(max_new_tokens=16)).tokens
    assert ours == [theirs(ids) for ids in prompts]

    # from the command line: import (the float32 config.json: float32 compute recorded), then generate
    # with the model's own tokenizer; a checkpoint imported as bfloat16 computes in float32 on request
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    prompt = "w254 w190 w152 w80"  # 32 tokens without <eos>, where bfloat16 compute drifts off
    ids = tok.encode(prompt).ids
    expected = tok.decode([*ids, *theirs(ids, 32)])  # "w254 ... w80 w.. w.."
    for ckpt, import_keys in (("ckpt", []), ("ckpt16", ["dtype=bfloat16"])):
        imp = subprocess.run([sys.executable, "-m", "maxlite.bridge.hf", "import", "hf", ckpt, *import_keys], **run)
        assert imp.returncode == 0, imp.stderr[-3000:]
        recorded = "float32" if not import_keys else "bfloat16"
        assert f"dtype: {recorded}" in (tmp_path / ckpt / "recipe.yml").read_text()
    for ckpt, generate_keys, same in (("ckpt", [], True), ("ckpt16", [], False), ("ckpt16", ["dtype=float32"], True)):
        out = subprocess.run([sys.executable, "-m", "maxlite.generate", ckpt, *generate_keys, "--prompt", prompt,
                              "--max-new-tokens", "32"], **run)
        assert out.returncode == 0, out.stderr[-3000:]
        assert (out.stdout.rstrip("\n") == expected) == same, (ckpt, generate_keys)  # bf16 drifts off by token 32


def test_cli_on_a_trained_run(tmp_path):
    argv = [a for a in SMALL if not a.startswith("vocab_size")]  # the bundled 4096-id tokenizer's model
    from maxlite.train import train
    train(C.load([*argv, "steps=2", "run_name=g", f"base_output_directory={tmp_path}/runs"]))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "And God said"}) + "\n\n" + json.dumps({"prompt": "In the"}) + "\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(2))
    out = subprocess.run([sys.executable, "-m", "maxlite.generate", "runs/g", "--prompts-file", "prompts.jsonl",
                          "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9"],
                         cwd=tmp_path, env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["And God said", "In the"]
    assert all(isinstance(r["completion"], str) and r["completion"] for r in rows)
    assert "maxlite: generated " in out.stderr and " tokens/s; " in out.stderr
    from maxlite.generate import main
    assert main([str(tmp_path / "nothing"), "--prompt", "x"]) == 2


def test_on_a_tensor_parallel_mesh_the_cache_splits_kv_heads_and_decodes_the_same():
    import jax
    from jax.sharding import PartitionSpec

    from maxlite import mesh as mesh_lib
    from maxlite.build import build
    from maxlite.models import decode

    cfg, _, params = _model("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
    built = build(cfg, jax.devices()[:4])
    with jax.set_mesh(built.mesh), nnx.logical_axis_rules(mesh_lib.DECODE_RULES):
        cache = jax.jit(lambda: decode.empty_cache(cfg, 3, 16))()
    (kv, _), = cache.stacks.values()  # one kind of layer: one stack
    assert kv.k_LBSKH.sharding.spec == PartitionSpec(None, None, None, "tensor")  # [L, B, S, K, H]
    leaves = map(jax.device_put, jax.tree.leaves(params), jax.tree.leaves(built.shardings.params))
    sharded = jax.tree.unflatten(jax.tree.structure(params), list(leaves))
    on_mesh = generate_ids(built.cfg, sharded, PROMPTS, Sampling(max_new_tokens=8), mesh=built.mesh).tokens
    assert on_mesh == generate_ids(cfg, params, PROMPTS, Sampling(max_new_tokens=8)).tokens


def test_on_a_context_parallel_mesh_the_prefill_splits_the_prompt_and_decodes_the_same():
    """context=2: the prompts (padded to a multiple of the shards) prefill through the training
    attention split over the context axis; the tokens equal one device's."""
    import jax

    from maxlite.build import build
    from maxlite.models import decode

    cfg, _, params = _model("ici_fsdp_parallelism=2", "ici_context_parallelism=2", "per_device_batch_size=0.5",
                            "attention=blockwise", "attention_block_size=4")
    built = build(cfg, jax.devices()[:4])
    assert decode.prompt_length(built.cfg, 9, 2) % 2 == 0
    leaves = map(jax.device_put, jax.tree.leaves(params), jax.tree.leaves(built.shardings.params))
    sharded = jax.tree.unflatten(jax.tree.structure(params), list(leaves))
    on_mesh = generate_ids(built.cfg, sharded, PROMPTS, Sampling(max_new_tokens=6), mesh=built.mesh).tokens
    assert on_mesh == generate_ids(cfg, params, PROMPTS, Sampling(max_new_tokens=6)).tokens


@pytest.mark.parametrize("extra, without", [((), ""),
                                            (("decoder_block=gemma3", "sliding_window=4", "base_num_decoder_layers=6"),
                                             "sliding_window=0"),
                                            (tuple(FAMILIES["deepseek-mla"]), "attention_type=global")],
                         ids=["global", "windowed", "mla"])
def test_the_reported_cache_bytes_per_token_are_the_caches_own(extra, without):
    """What `generate` reports per token is the size of the caches decoding allocated for the longest
    row (prompt + new tokens), divided by that length: a sliding-window layer's keeps its window only,
    a latent-attention layer its latent (smaller than grouped-query K and V of the same heads)."""
    from maxlite.models import decode

    cfg, _, params = _model(*extra)
    prompt, new = [5, 6, 7, 8, 9, 10, 11], 9
    got = generate_ids(cfg, params, [prompt], Sampling(max_new_tokens=new))
    length = len(prompt) + new
    cache = decode.empty_cache(cfg, 1, length)
    per_layer = [layers for layers, _ in cache.stacks.values()]  # the slot-position record is bookkeeping
    allocated = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(per_layer))
    assert got.cache_bytes_per_token == allocated / length
    if extra:  # the same model without a window (or the latent) keeps more
        everything = decode.empty_cache(_model(*extra, without)[0], 1, length)
        assert allocated < sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(
            [layers for layers, _ in everything.stacks.values()]))
