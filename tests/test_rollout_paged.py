"""The paged rollout engine (maxlite/rollout/paged.py, maxlite/models/paged_cache.py): greedy
completions equal today's static sampler (decode.generate_tokens) token for token and the contiguous
engine's log-probs, for GQA, a sliding-window model, MLA, DeepSeek sparse attention and a delta-net hybrid, with fewer slots than
sequences and blocks small enough that every sequence spans several; its log-probs equal the
trainer's recomputed token_logps; a prompt's G completions share its full blocks (the cache held
measured against copying them); every block is back on the free list after generate, a pool of
the bare minimum still finishes (admission waits for blocks); a pool too small, or a kind with no
paged cache, is refused in one line before any work."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import api, config as C
from maxlite.data.preference import row
from maxlite.models import decode, paged_cache
from maxlite.objectives.rollout import sampler_row
from maxlite.rollout import engine as E
from maxlite.rollout.continuous import ContinuousEngine
from maxlite.rollout.paged import PagedEngine
from maxlite.step import token_logps
from tests.helpers import SMALL

PROMPTS = [[5, 17, 100, 3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [150, 1, 2]]
G = 2  # 6 sequences over 4 slots: two slots are refilled
BLOCK = 4  # positions per block: every sequence spans 2-5 blocks, a prompt's last block is partial or full


@functools.cache
def _small():
    cfg = C.load([*SMALL, "dtype=float32", "init_scale=0.5"])  # large weights: no near-ties
    graphdef, params = nnx.split(api.create_model(cfg, seed=3), nnx.Param)
    return cfg, graphdef, params


def _static_greedy(graphdef, params, cfg, prompts, n: int, generations: int) -> np.ndarray:
    """Today's sampler: the prompts repeated G times in one static batch."""
    P = decode.prompt_length(cfg, max(map(len, prompts)))
    padded = np.zeros((len(prompts), P), np.int32)
    for r, ids in zip(padded, prompts):
        r[:len(ids)] = ids
    lengths = np.array([len(p) for p in prompts], np.int32)
    fn = jax.jit(functools.partial(decode.generate_tokens, graphdef, max_new_tokens=n, temperature=0.0, top_k=0,
                                   top_p=1.0, eos_id=-1))
    return np.asarray(fn(params, jnp.repeat(padded, generations, 0), jnp.repeat(lengths, generations, 0),
                         jax.random.key(0))[0])


def _greedy_equals_static_and_contiguous(cfg, graphdef, params, prompts, n: int):
    sampling = E.Sampling(n, temperature=0.0, generations=G)
    paged = PagedEngine(cfg, graphdef, 4, 64, block_size=BLOCK).generate(params, prompts, sampling, jax.random.key(0))
    static = _static_greedy(graphdef, params, cfg, prompts, n, G)
    assert [t.tolist() for t in paged.tokens] == static.tolist()
    contiguous = ContinuousEngine(cfg, graphdef, 4, 64).generate(params, prompts, sampling, jax.random.key(0))
    np.testing.assert_allclose(np.concatenate(paged.logps), np.concatenate(contiguous.logps), atol=1e-4)
    assert paged.stats["free_blocks"] == paged.stats["num_blocks"] - 1  # every block back (the null block aside)
    assert paged.stats["peak_blocks"] > 0


@pytest.mark.parametrize("read", [256, 12])  # 12: three blocks per read, the last read shifted back to fit
def test_greedy_equals_the_static_sampler_and_the_contiguous_engine(read, monkeypatch):
    monkeypatch.setattr(paged_cache, "READ", read)
    _greedy_equals_static_and_contiguous(*_small(), PROMPTS, n=8)


# GQA with sliding-window layers (mistral: window 6, passed during decoding), MLA's latent (deepseek_v3),
# the delta-net's fixed state beside paged attention (qwen3_5_text), Kimi delta attention's beside paged
# NoPE latent attention (kimi_linear), DeepSeek sparse attention's latents and indexer keys (deepseek_v32:
# each query keeps 6 of up to 15 positions, read through the block table)
FAMILIES = ["mistral", "deepseek_v3", "qwen3_5_text", "kimi_linear", "deepseek_v32"]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_equals_the_static_sampler_on_imported_families(name, tmp_path):
    from maxlite.bridge import hf, params as P
    from maxlite.state import abstract_params
    from tests import hf_models

    hf_models.model(name).save_pretrained(str(tmp_path))
    cfg, pure = hf.import_hf(str(tmp_path), ["dtype=float32", "max_target_length=32"])
    params = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    graphdef, _ = abstract_params(cfg)
    _greedy_equals_static_and_contiguous(cfg, graphdef, params, [[t % 200 for t in p] for p in PROMPTS], n=6)


def test_logps_equal_the_trainers_token_logps():
    cfg, graphdef, params = _small()
    done = PagedEngine(cfg, graphdef, 4, 64, block_size=BLOCK).generate(params, PROMPTS, E.Sampling(8, 1.0, G),
                                                                        jax.random.key(1))
    rows, sampler = [], []
    for i, toks in enumerate(done.tokens):
        prompt = PROMPTS[i // G]
        ids = np.asarray(prompt + toks.tolist(), np.int32)
        rows.append(row(ids, np.arange(len(ids)) >= len(prompt), 24))
        sampler.append(sampler_row(done.logps[i], len(prompt), 24))
    rows, sampler = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}, np.stack(sampler)
    theirs = np.asarray(token_logps(params, graphdef, rows))
    w = np.asarray(rows["weights"]) > 0
    assert w.sum() == sum(map(len, done.tokens))
    np.testing.assert_allclose(sampler[w], theirs[w], rtol=1e-5, atol=2e-5)


def test_a_prompts_completions_share_its_full_blocks():
    """G=8 completions of one 42-token prompt: its 10 full blocks held once, not 8 times; the same tokens."""
    cfg, graphdef, params = _small()
    prompt, n, g = [[(7 * i) % 250 + 1 for i in range(42)]], 6, 8
    sampling = E.Sampling(n, 1.0, g)
    shared, copied = (PagedEngine(cfg, graphdef, 8, 64, block_size=BLOCK, share_prefix=share).generate(
        params, prompt, sampling, jax.random.key(3)) for share in (True, False))
    assert [t.tolist() for t in shared.tokens] == [t.tolist() for t in copied.tokens]
    per_sequence = -(-(42 + n) // BLOCK)  # 12 blocks: positions [0, 48)
    assert copied.stats["peak_blocks"] == g * per_sequence
    assert shared.stats["peak_blocks"] == 42 // BLOCK + g * (per_sequence - 42 // BLOCK)  # 10 + 8 × 2
    assert shared.stats["free_blocks"] == shared.stats["num_blocks"] - 1
    print(f"cache held for G={g}: {shared.stats['peak_blocks'] * shared.stats['block_bytes']} bytes shared, "
          f"{copied.stats['peak_blocks'] * copied.stats['block_bytes']} copied")


def test_the_smallest_pool_finishes_and_returns_every_block():
    """A pool holding only the longest sequence's blocks: sequences wait for blocks, and still equal
    the contiguous engine's."""
    cfg, graphdef, params = _small()
    sampling = E.Sampling(8, 0.0, G)
    need = -(-(max(map(len, PROMPTS)) + 8) // BLOCK)
    done = PagedEngine(cfg, graphdef, 4, 64, block_size=BLOCK, num_blocks=need + 1).generate(
        params, PROMPTS, sampling, jax.random.key(0))
    contiguous = ContinuousEngine(cfg, graphdef, 4, 64).generate(params, PROMPTS, sampling, jax.random.key(0))
    assert [t.tolist() for t in done.tokens] == [t.tolist() for t in contiguous.tokens]
    assert done.stats["peak_blocks"] <= need and done.stats["free_blocks"] == need


def test_too_small_a_pool_is_refused_in_one_line_before_any_work():
    cfg, graphdef, params = _small()
    engine = PagedEngine(cfg, graphdef, 4, 64, block_size=BLOCK, num_blocks=5)  # 4 usable; 9 + 8 tokens need 5
    with pytest.raises(C.ConfigError, match="rollout_num_blocks=5 holds 4 blocks .* needs 5: raise it") as caught:
        engine.generate(params, PROMPTS, E.Sampling(8, 0.0, G), jax.random.key(0))
    assert "\n" not in str(caught.value) and not engine._compiled  # nothing compiled


def test_kinds_without_a_paged_cache_are_refused_in_one_line():
    why = paged_cache.refusal({"attention", "gemma4_local", "gemma4_global_shared"})
    assert why is not None and "\n" not in why and "gemma4_global_shared, gemma4_local" in why
    assert paged_cache.refusal({"attention", "mla", "dsa", "gated_deltanet", "mamba2", "none"}) is None
    grpo = ["train_objective=grpo", "dataset_type=prompts", "max_target_length=32", "rollout_paged_kv=true",
            "reward_functions=[maxlite.objectives.rewards:exact_answer]", "enable_tensorboard=false"]
    assert C.load([*SMALL, *grpo]).rollout_paged_kv
    # refused when the recipe is read
    with pytest.raises(C.ConfigError, match="rollout_paged_kv=true: mixer kind.*gemma4_local"):
        C.load(["base.yml", "model_name=gemma4-tiny", *grpo])
    assert C.load(["base.yml", "model_name=deepseek-v3.2", *grpo]).rollout_paged_kv  # DSA pages (below)


def test_the_config_chooses_the_paged_engine():
    cfg, graphdef, _ = _small()
    engine = E.make_engine(C.load([*SMALL, "rollout_paged_kv=true", "rollout_block_size=8",
                                   "rollout_num_blocks=64"]), graphdef)
    assert isinstance(engine, PagedEngine) and (engine.block_size, engine.num_blocks) == (8, 64)
    assert type(E.make_engine(cfg, graphdef)) is ContinuousEngine


def test_sequences_ending_early_free_their_blocks_for_waiting_ones():
    """At temperature 1 with a tenth of the vocabulary ending a completion, 12 sequences over 3 slots
    and a pool of the longest sequence's blocks + 2: the same draws as the contiguous engine (a
    token's key depends on its sequence, not its slot), and every block back."""
    cfg, graphdef, params = _small()
    prompts = PROMPTS + [[7, 8]]
    sampling = E.Sampling(10, 1.0, 3, marker_ids=tuple(range(100, 100 + cfg.vocab_size // 10)))
    need = -(-(max(map(len, prompts)) + 10) // BLOCK)
    paged = PagedEngine(cfg, graphdef, 3, 32, block_size=BLOCK, num_blocks=need + 3).generate(
        params, prompts, sampling, jax.random.key(5))
    contiguous = ContinuousEngine(cfg, graphdef, 3, 32).generate(params, prompts, sampling, jax.random.key(5))
    assert [t.tolist() for t in paged.tokens] == [t.tolist() for t in contiguous.tokens]
    assert paged.stops == contiguous.stops and "marker" in paged.stops and "length" in paged.stops
    np.testing.assert_allclose(np.concatenate(paged.logps), np.concatenate(contiguous.logps), atol=1e-4)
    assert paged.stats["free_blocks"] == need + 2
