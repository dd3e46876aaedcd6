"""The rollout engine (maxlite/rollout/): greedy completions equal today's static sampler
(decode.generate_tokens) token for token on every family the bridge imports (tests/hf_models.py;
a default lane covering every mixer kind, the rest `slow`), with fewer slots than sequences so slots
are refilled; its log-probs equal the trainer's recomputed token_logps; at temperature 1 what it
samples does not depend on max_num_seqs; with top_k / top_p it samples from the cut distribution
(checked in numpy against the trainer's logits) and reports that distribution's log-probs; each
completion stops for the right reason."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import api, config as C
from maxlite.data.preference import row
from maxlite.models import decode
from maxlite.models.kinds import MIXERS
from maxlite.objectives.rollout import sampler_row
from maxlite.rollout import engine as E
from maxlite.rollout.continuous import ContinuousEngine
from maxlite.step import token_logps
from tests.helpers import SMALL

PROMPTS = [[5, 17, 100, 3, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [150, 1, 2]]
G = 2  # 6 sequences over 4 slots: two slots are refilled


@functools.cache
def _small():
    cfg = C.load([*SMALL, "dtype=float32", "init_scale=0.5"])  # large weights: no near-ties
    graphdef, params = nnx.split(api.create_model(cfg, seed=3), nnx.Param)
    return cfg, graphdef, params


def _static_greedy(graphdef, params, cfg, prompts, n: int, generations: int) -> np.ndarray:
    """Today's sampler: the prompts repeated G times in one static batch (rollout.Rollout's old path)."""
    P = decode.prompt_length(cfg, max(map(len, prompts)))
    padded = np.zeros((len(prompts), P), np.int32)
    for r, ids in zip(padded, prompts):
        r[:len(ids)] = ids
    lengths = np.array([len(p) for p in prompts], np.int32)
    fn = jax.jit(functools.partial(decode.generate_tokens, graphdef, max_new_tokens=n, temperature=0.0, top_k=0,
                                   top_p=1.0, eos_id=-1))
    return np.asarray(fn(params, jnp.repeat(padded, generations, 0), jnp.repeat(lengths, generations, 0),
                         jax.random.key(0))[0])


def _greedy_equals_static(cfg, graphdef, params, prompts, n: int = 5):
    done = ContinuousEngine(cfg, graphdef, max_num_seqs=4, max_num_batched_tokens=64).generate(
        params, prompts, E.Sampling(n, temperature=0.0, generations=G), jax.random.key(0))
    static = _static_greedy(graphdef, params, cfg, prompts, n, G)
    assert [t.tolist() for t in done.tokens] == static.tolist()
    assert done.stops == ["length"] * len(static)
    assert done.stats["steps"] < len(static) * n  # slots ran side by side; 2 were refilled
    assert done.stats["prefills"] == 1  # 3 prompts of ≤ 16 padded tokens fit 64


def test_greedy_equals_the_static_sampler_with_slots_refilled():
    _greedy_equals_static(*_small(), PROMPTS, n=8)


# every mixer kind: GQA (a global layer and a sliding-window ring), MLA's latent, the gated delta-net's
# state beside attention, Gemma 4's local/global layers and those sharing K/V, Nemotron-H's Mamba-2 state
# (and its layers without a mixer or without an MLP), Llama 4's chunked ring, Kimi delta attention's
# per-channel state beside NoPE latent attention
DEFAULT_LANE = ["llama", "mistral", "deepseek_v3", "qwen3_5_text", "gemma4", "nemotron_h", "llama4_text", "kimi_linear"]


def _hf_families():
    from tests import hf_models
    return [pytest.param(name, marks=() if name in DEFAULT_LANE else pytest.mark.slow) for name in hf_models.CONFIGS]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("name", _hf_families())
def test_greedy_equals_the_static_sampler_on_every_imported_family(name, tmp_path):
    from maxlite.bridge import hf, params as P
    from maxlite.state import abstract_params
    from tests import hf_models

    hf_models.model(name).save_pretrained(str(tmp_path))
    cfg, pure = hf.import_hf(str(tmp_path), ["dtype=float32", "max_target_length=32"])
    params = P.to_state(cfg, P.to_jax_inplace(P.to_pure(pure)))
    graphdef, _ = abstract_params(cfg)
    # the windowed families' windows (hf_models.WINDOW = 6) are passed during prefill and decoding
    _greedy_equals_static(cfg, graphdef, params, [[t % 200 for t in p] for p in PROMPTS], n=5)


def test_the_layers_matmul_weights_are_held_in_the_compute_dtype_and_give_the_same_tokens():
    """bf16 compute over float32 masters (the default dtypes): the engine holds the layers' matmul
    weights and its untied head rounded to bfloat16 once (on a CPU as their bits), what every step
    rounded them to before, and keeps the norms' and the embedding's as stored; its greedy tokens are
    the static sampler's on the masters, and what it samples and the log-probs it reports are, bit for bit, an
    engine's that re-rounds the masters each step."""
    from maxlite.rollout.weights import held_paths

    cfg = C.load([*SMALL, "init_scale=0.5"])
    assert (cfg.dtype, cfg.weight_dtype) == ("bfloat16", "float32")
    graphdef, params = nnx.split(api.create_model(cfg, seed=3), nnx.Param)
    engine = ContinuousEngine(cfg, graphdef, 4, 64)
    held = dict(nnx.to_flat_state(engine.held(params)))
    assert held_paths(cfg, graphdef, params) == {("layers", part, w) for part, ws in
                                                 (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for w in ws} | {
        ("unembedding",)}
    assert held[("layers", "attn", "q")].get_value().dtype == jnp.uint16
    assert held[("unembedding",)].get_value().dtype == jnp.uint16
    assert held[("layers", "attn_norm", "scale")].get_value().dtype == jnp.float32
    assert held[("embedding",)].get_value().dtype == jnp.float32
    _greedy_equals_static(cfg, graphdef, params, PROMPTS, n=8)
    sampling = E.Sampling(8, 1.0, G)
    done = engine.generate(params, PROMPTS, sampling, jax.random.key(1))
    plain = ContinuousEngine(cfg, graphdef, 4, 64, hold_weights=False).generate(params, PROMPTS, sampling,
                                                                               jax.random.key(1))
    assert [t.tolist() for t in done.tokens] == [t.tolist() for t in plain.tokens]
    assert all(np.array_equal(a, b) for a, b in zip(done.logps, plain.logps))
    assert len(set(np.concatenate(done.tokens).tolist())) > 8  # sampled, not one token repeated


@pytest.mark.parametrize("preset", ["qwen3.5-27b", "deepseek-v3"])
def test_held_weights_sample_as_the_masters_for_other_mixers(preset):
    """The gated delta-net beside attention, and latent attention (whose decode absorbs kv_b) with
    DeepSeekMoE: bf16 compute over float32 masters, the same samples and log-probs held or not."""
    from tests.helpers import shrunk

    cfg = C.load(shrunk(preset))
    graphdef, params = nnx.split(api.create_model(cfg, seed=0), nnx.Param)
    prompts, sampling = [[t % 200 for t in p] for p in PROMPTS], E.Sampling(5, 1.0, G)
    done, plain = (ContinuousEngine(cfg, graphdef, 4, 64, hold_weights=hold).generate(params, prompts, sampling,
                                                                                      jax.random.key(2))
                   for hold in (True, False))
    assert [t.tolist() for t in done.tokens] == [t.tolist() for t in plain.tokens]
    assert all(np.array_equal(a, b) for a, b in zip(done.logps, plain.logps))


def test_a_weight_used_other_than_cast_keeps_its_stored_form():
    """The gated delta-net's A_log (exp'd in float32), its dt bias and the norms stay float32 masters;
    its projections and convolution taps are held."""
    from maxlite.rollout.weights import held_paths
    from tests.helpers import shrunk

    cfg = C.load(shrunk("qwen3.5-27b"))
    graphdef, params = nnx.split(api.create_model(cfg, seed=0), nnx.Param)
    paths = held_paths(cfg, graphdef, params)
    gdn = ("layers", "blocks", 0, "attn")
    assert {gdn + (w,) for w in ("q", "k", "v", "z", "a", "b", "o", "conv_q")} <= paths
    assert not {gdn + (w,) for w in ("A_log", "dt_bias")} & paths
    assert not any(path[-1] == "scale" for path in paths)


def test_logps_equal_the_trainers_token_logps():
    cfg, graphdef, params = _small()
    done = ContinuousEngine(cfg, graphdef, 4, 64).generate(params, PROMPTS, E.Sampling(8, 1.0, G),
                                                           jax.random.key(1))
    rows, sampler = _rows(done)
    theirs = np.asarray(token_logps(params, graphdef, rows))
    w = np.asarray(rows["weights"]) > 0
    assert w.sum() == sum(map(len, done.tokens))
    np.testing.assert_allclose(sampler[w], theirs[w], rtol=1e-5, atol=2e-5)
    assert not sampler[~w].any()  # zeros off the completion


def _rows(done, T: int = 24):
    """The completions as training rows (preference.row) and their sampler log-probs at the targets."""
    rows, sampler = [], []
    for i, toks in enumerate(done.tokens):
        prompt = PROMPTS[i // G]
        ids = np.asarray(prompt + toks.tolist(), np.int32)
        rows.append(row(ids, np.arange(len(ids)) >= len(prompt), T))
        sampler.append(sampler_row(done.logps[i], len(prompt), T))
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}, np.stack(sampler)


def _nucleus(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """(the token ids a top-k-then-top-p sampler may draw, their renormalised log-probs), in float64:
    the k most likely, then the fewest of those whose renormalised probability reaches top_p."""
    z = logits_V.astype(np.float64) / temperature
    order = np.argsort(-z)[:top_k or None]
    probs = np.exp(z[order] - z[order].max())
    probs /= probs.sum()
    kept = order[:np.searchsorted(np.cumsum(probs), top_p) + 1]
    shifted = z[kept] - z[kept].max()
    return kept, shifted - np.log(np.exp(shifted).sum())


def test_with_top_k_1_every_token_is_greedy_with_log_prob_0():
    cfg, graphdef, params = _small()
    engine = ContinuousEngine(cfg, graphdef, 4, 64)
    greedy = engine.generate(params, PROMPTS, E.Sampling(8, 0.0, G), jax.random.key(0))
    done = engine.generate(params, PROMPTS, E.Sampling(8, 1.0, G, top_k=1), jax.random.key(1))
    assert [t.tolist() for t in done.tokens] == [t.tolist() for t in greedy.tokens]
    assert not np.concatenate(done.logps).any()  # log 1: the distribution sampled holds one token


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.7), (0.7, 5, 0.9)])
def test_cut_sampling_draws_from_the_nucleus_and_reports_its_log_probs(temperature, top_k, top_p):
    """Each sampled token lies in the top-k/top-p set computed in numpy from the trainer's logits, and
    its log-prob is that renormalised set's, not the full distribution's (the loss's ratio divides by it)."""
    cfg, graphdef, params = _small()
    done = ContinuousEngine(cfg, graphdef, 4, 64).generate(
        params, PROMPTS, E.Sampling(8, temperature, G, top_k=top_k, top_p=top_p), jax.random.key(1))
    rows, sampler = _rows(done)
    model = nnx.merge(graphdef, params)
    logits_BTV = np.asarray(model.logits(model.forward(rows["inputs"], rows["positions"], rows["segment_ids"])[0]))
    targets, w = np.asarray(rows["targets"]), np.asarray(rows["weights"]) > 0
    sizes, cut = [], []
    for b, t in zip(*np.nonzero(w)):
        kept, logps = _nucleus(logits_BTV[b, t], temperature, top_k, top_p)
        assert targets[b, t] in kept
        np.testing.assert_allclose(sampler[b, t], logps[list(kept).index(targets[b, t])], atol=1e-4)
        full = jax.nn.log_softmax(logits_BTV[b, t].astype(np.float64) / temperature)[targets[b, t]]
        sizes.append(len(kept))
        cut.append(sampler[b, t] - full)
    assert 1 < max(sizes) and max(sizes) < logits_BTV.shape[-1]  # the cut left choices, and cut something
    assert max(cut) > 1e-2  # the renormalised log-probs are above the full distribution's


def test_batches_of_other_prompt_lengths_reuse_the_compiled_programs():
    """A run's batches have other longest prompts (grpo_math.yml's word problems: 40 to 89 tokens): the
    engine pads each batch to its longest prompt's power-of-two bucket, so the second batch (longest 12
    tokens, the first 9: both in the bucket of 16) runs on the first one's programs, and each batch's
    greedy tokens are still the static sampler's."""
    cfg, graphdef, params = _small()
    cfg = dataclasses.replace(cfg, max_target_length=32)  # a prompt budget of 32 - 6 tokens
    engine = ContinuousEngine(cfg, graphdef, max_num_seqs=4, max_num_batched_tokens=64)
    for prompts in (PROMPTS, [[9, 8, 7], list(range(60, 72))]):
        done = engine.generate(params, prompts, E.Sampling(6, temperature=0.0, generations=G), jax.random.key(0))
        assert [t.tolist() for t in done.tokens] == _static_greedy(graphdef, params, cfg, prompts, 6, G).tolist()
    assert {P for P, *_ in engine._compiled} == {16}  # one padded length: the programs of the first batch


def test_a_bucket_is_the_next_power_of_two_inside_the_budget():
    from maxlite.rollout.sampling import bucket
    assert [bucket(n, 96, least=16) for n in (1, 16, 17, 33, 64, 65, 96)] == [16, 16, 32, 64, 64, 96, 96]
    assert bucket(120, 96, least=16) == 120  # a prompt over the budget: its own length (max_position_embeddings rules)
    assert bucket(5, 8, least=16) == 8
    assert [bucket(n, 100) for n in (0, 1, 3, 9)] == [1, 1, 4, 16]  # a tool round's budget: no floor


def test_what_is_sampled_does_not_depend_on_the_slots():
    cfg, graphdef, params = _small()
    prompts = PROMPTS + [[7, 8]]
    got = [ContinuousEngine(cfg, graphdef, slots, 32).generate(params, prompts, E.Sampling(6, 1.0, 3),
                                                              jax.random.key(2))
           for slots in (1, 5, 12)]
    for other in got[1:]:
        assert [t.tolist() for t in other.tokens] == [t.tolist() for t in got[0].tokens]
        # other batch shapes: the same log-probs up to float32 rounding
        np.testing.assert_allclose(np.concatenate(other.logps), np.concatenate(got[0].logps), atol=1e-4)
    assert got[2].stats["ended_slot_steps"] == 0 and got[2].stats["steps"] == 6  # all 12 at once, full length
    assert len({tuple(t.tolist()) for t in got[0].tokens}) > len(prompts)  # a prompt's completions differ


def test_each_completion_stops_for_its_reason():
    cfg, graphdef, params = _small()
    n = 8
    free = ContinuousEngine(cfg, graphdef, 4, 64).generate(params, PROMPTS, E.Sampling(n, 0.0, 1),
                                                           jax.random.key(0))
    paths = [t.tolist() for t in free.tokens]
    eos, marker = paths[0][2], paths[1][3]
    assert eos not in paths[0][:2] and marker not in paths[1][:3] and eos != marker
    sampling = E.Sampling(n, 0.0, 1, eos_id=eos, marker_ids=(marker,))
    done = ContinuousEngine(cfg, graphdef, 2, 64).generate(params, PROMPTS, sampling, jax.random.key(0))
    for path, toks, stop in zip(paths, done.tokens, done.stops):
        ends = [k for k, t in enumerate(path) if t in (eos, marker)]
        k = ends[0] + 1 if ends else n
        assert toks.tolist() == path[:k]  # greedy: the ends only cut the path
        assert stop == ("length" if not ends else "eos" if path[k - 1] == eos else "marker")
    assert done.stops[:2] == ["eos", "marker"]


def test_every_cache_kind_declares_its_batch_axes():
    for kind in MIXERS.values():
        assert kind.cache().BATCH_AXES == (1, 0), kind.name


def test_vllm_is_refused_in_one_line_before_any_work():
    why = E.refusal("vllm")
    assert why is not None and "\n" not in why and "vllm" in why
    grpo = [*SMALL, "train_objective=grpo", "dataset_type=prompts", "max_target_length=32",
            "reward_functions=[maxlite.objectives.rewards:exact_answer]"]
    assert C.load(grpo).rollout_engine == "maxlite"
    with pytest.raises(C.ConfigError, match="rollout_engine=vllm"):  # when the recipe is read
        C.load([*grpo, "rollout_engine=vllm"])


def test_errors_are_one_line():
    cfg, graphdef, params = _small()
    with pytest.raises(C.ConfigError, match="top_p in \\(0, 1\\]"):
        ContinuousEngine(cfg, graphdef, 2, 64).generate(params, PROMPTS, E.Sampling(4, top_p=0.0), jax.random.key(0))
    with pytest.raises(C.ConfigError, match="max_num_batched_tokens=4 is below"):
        ContinuousEngine(cfg, graphdef, 2, 4).generate(params, PROMPTS, E.Sampling(4), jax.random.key(0))
    with pytest.raises(C.ConfigError, match="at least one token"):
        ContinuousEngine(cfg, graphdef, 2, 64).generate(params, [[]], E.Sampling(4), jax.random.key(0))
