import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import dot_equations
from maxlite import config as C
from maxlite.models import Transformer
from maxlite.models.flops import active_param_count, attention_flops, param_count, train_flops_per_step
from maxlite.state import abstract_params


@pytest.mark.parametrize("model_name, published", [
    ("llama2-7b", "6.74"), ("llama3-8b", "8.03"), ("llama3.1-8b", "8.03"), ("llama3.1-70b", "70.6"),
    ("llama3.1-405b", "405.9"), ("mistral-7b", "7.24"), ("llama3.2-1b", "1.24"),
    ("llama3.2-3b", "3.21"), ("gpt3-126m", "0.125"), ("mixtral-8x7b", "46.7"), ("mixtral-8x22b", "141"),
    ("qwen3-30b-a3b", "30.5"), ("qwen3-235b-a22b", "235"), ("gpt-oss-20b", "20.91"), ("gpt-oss-120b", "116.83"),
    ("gemma4-31b", "30.7"), ("gemma4-26b-a4b", "25.2"),
])
def test_preset_parameter_counts_match_published(model_name, published):
    """The count, in billions, rounds to the published figure at its published precision."""
    cfg = C.load(["base.yml", f"model_name={model_name}"])
    _, params = abstract_params(cfg)
    decimals = len(published.partition(".")[2])
    assert f"{param_count(params) / 1e9:.{decimals}f}" == published


@pytest.mark.parametrize("model_name, published", [
    ("mixtral-8x7b", "12.9"), ("mixtral-8x22b", "39"), ("qwen3-235b-a22b", "22"), ("gemma4-26b-a4b", "3.8")])
def test_moe_active_parameter_counts_match_published(model_name, published):
    """Active parameters (the unchosen experts left out), in billions, as the model cards state.
    (Qwen3-30B-A3B's card says 3.3B; the count, 3.35B, equals what transformers' model holds.)"""
    cfg = C.load(["base.yml", f"model_name={model_name}"])
    total = param_count(abstract_params(cfg)[1])
    decimals = len(published.partition(".")[2])
    assert f"{active_param_count(cfg, total) / 1e9:.{decimals}f}" == published


def tiny(**overrides):
    args = ["base.yml", "model_name=tiny", "dtype=float32", "max_target_length=32"]
    return C.load(args + [f"{k}={v}" for k, v in overrides.items()])


def init_model(cfg, seed=0):
    with nnx.use_eager_sharding(False):
        return Transformer(cfg, rngs=nnx.Rngs(seed))


def run(model, tokens, positions=None, segments=None):
    B, T = tokens.shape
    positions = np.broadcast_to(np.arange(T), (B, T)) if positions is None else positions
    segments = np.ones((B, T), np.int32) if segments is None else segments
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)))


@pytest.mark.parametrize("block", ["llama2", "gpt3"])
def test_packed_documents_do_not_attend_across_each_other(block):
    extra = {"decoder_block": block, "use_bias": block == "gpt3"}
    model = init_model(tiny(**extra))
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(0, 4096, 12), rng.integers(0, 4096, 20)
    packed = np.concatenate([doc_a, doc_b])[None]
    positions = np.concatenate([np.arange(12), np.arange(20)])[None]
    segments = np.concatenate([np.ones(12), 2 * np.ones(20)]).astype(np.int32)[None]
    logits_packed = run(model, packed, positions, segments)
    np.testing.assert_allclose(logits_packed[0, :12], run(model, doc_a[None])[0], atol=1e-5)
    np.testing.assert_allclose(logits_packed[0, 12:], run(model, doc_b[None])[0], atol=1e-5)


def test_causal_future_tokens_do_not_change_the_past():
    model = init_model(tiny())
    tokens = np.random.default_rng(1).integers(0, 4096, (2, 16))
    changed = tokens.copy()
    changed[:, 10:] = (changed[:, 10:] + 1) % 4096
    np.testing.assert_allclose(run(model, tokens)[:, :10], run(model, changed)[:, :10], atol=1e-6)
    assert not np.allclose(run(model, tokens)[:, 10:], run(model, changed)[:, 10:])


def test_scan_and_unrolled_layers_compute_the_same_function():
    scanned = init_model(tiny(scan_layers=True))
    unrolled = init_model(tiny(scan_layers=False))
    # Copy the stacked weights layer by layer into the unrolled model.
    _, stacked = nnx.split(scanned, nnx.Param)
    _, flat = nnx.split(unrolled, nnx.Param)
    flat_dict, stacked_dict = flat.to_pure_dict(), stacked.to_pure_dict()
    flat_dict["embedding"] = stacked_dict["embedding"]
    flat_dict["unembedding"] = stacked_dict["unembedding"]
    flat_dict["final_norm"] = stacked_dict["final_norm"]
    for i in range(4):
        flat_dict["layers"][i] = jax.tree.map(lambda x: x[i], stacked_dict["layers"])
    nnx.replace_by_pure_dict(flat, flat_dict)
    nnx.update(unrolled, flat)
    tokens = np.random.default_rng(2).integers(0, 4096, (2, 32))
    np.testing.assert_allclose(run(scanned, tokens), run(unrolled, tokens), atol=1e-5)


def _matmuls_of_gradient(remat_policy):
    """dot_general equations in the jaxpr of the logits' gradient (bf16 model, unrolled layers)."""
    cfg = tiny(dtype="bfloat16", scan_layers=False, remat_policy=remat_policy)
    graphdef, params = nnx.split(init_model(cfg))
    B, T = 1, 32
    tokens, positions = jnp.zeros((B, T), jnp.int32), jnp.broadcast_to(jnp.arange(T), (B, T))

    def total(params):
        return nnx.merge(graphdef, params)(tokens, positions, jnp.ones((B, T), jnp.int32)).sum()

    return len(list(dot_equations(jax.make_jaxpr(jax.grad(total))(params).jaxpr)))


def test_dot_remat_policies_keep_the_matmuls_they_name():
    """`save_dots` recomputes no matmul in the backward pass, `minimal` only attention's two batched
    ones (QKᵀ and PV) per layer, `full` eight of a layer's nine (not the MLP's down projection: its
    result only feeds the residual addition, whose gradient needs no value). On CPU each matmul is a
    custom VJP (maxlite/models/matmul.py), which JAX's own dot policies do not see: there both
    `save_dots` and `minimal` recomputed every matmul, as `full` does."""
    layers = tiny().base_num_decoder_layers
    none = _matmuls_of_gradient("none")
    assert _matmuls_of_gradient("save_dots") == none
    assert _matmuls_of_gradient("minimal") == none + 2 * layers
    assert _matmuls_of_gradient("full") == none + 8 * layers  # q, k, v, QKᵀ, PV, out, gate, up


def test_llama31_rope_scaling_matches_reference_rule():
    from maxlite.models.layers import rope_frequencies

    cfg = C.load(["base.yml", "model_name=llama3.1-8b"])
    scaled, plain = rope_frequencies(cfg), rope_frequencies(C.load(["base.yml", "model_name=llama3-8b"]))
    wavelen = 2 * np.pi / plain
    assert np.allclose(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # high freq kept
    assert np.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)  # low freq ÷ factor
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)


# latent attention (its query latent, key/value latent and up-projection) with values as wide as the
# queries and keys, so that dot_product pads nothing
MLA = ("attention_type=mla", "q_lora_rank=96", "kv_lora_rank=64", "qk_nope_head_dim=48", "qk_rope_head_dim=16",
       "v_head_dim=64")


@pytest.mark.parametrize("mixer", [(), MLA, MLA + ("mtp_num_layers=1",)], ids=["gqa", "mla", "mla-mtp"])
def test_flops_formula_agrees_with_xla_cost_analysis(mixer):
    """MaxText's count (models/flops.py) against XLA's own count of one unscanned forward+backward.

    XLA computes the full T×T score matrix, where the formula counts the causal half, and adds the
    elementwise work (norms, softmax, SiLU) the formula leaves out: with those accounted for, the
    two must agree closely."""
    from maxlite import step as step_lib

    cfg = C.resolve(C.load(["base.yml", "model_name=tiny", "per_device_batch_size=2", "max_target_length=128",
                            "scan_layers=false", "remat_policy=none", "attention=dot_product",
                            "num_vocab_tiling=1", "dtype=float32", *mixer]), 1)
    graphdef, params = abstract_params(cfg)
    B, T = 2, 128
    ids = jax.ShapeDtypeStruct((B, T), np.int32)
    batch = {"inputs": ids, "targets": ids, "positions": ids, "segment_ids": ids,
             "weights": jax.ShapeDtypeStruct((B, T), np.float32)}
    grad = jax.jit(jax.grad(lambda p, b: step_lib.loss_sums(p, graphdef, b)[0]))
    xla_flops = grad.lower(params, batch).compile().cost_analysis()["flops"]
    L, N, H = cfg.base_num_decoder_layers, cfg.base_num_query_heads, cfg.head_dim
    if mixer:  # MLA's heads: P + R = V wide
        H = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    # the masked half the formula leaves out (checked against XLA by the test below), × 3 for training
    L += cfg.mtp_num_layers  # a multi-token-prediction depth attends as a layer does
    expected = train_flops_per_step(cfg, batch_size=B) + 3 * L * attention_flops(B, T, N, H)
    assert xla_flops == pytest.approx(expected, rel=0.03), (xla_flops, expected)


def _xla_train_flops(cfg, B: int, T: int) -> float:
    """XLA's count of one unscanned forward+backward of the loss."""
    from maxlite import step as step_lib

    graphdef, params = abstract_params(cfg)
    ids = jax.ShapeDtypeStruct((B, T), np.int32)
    batch = {"inputs": ids, "targets": ids, "positions": ids, "segment_ids": ids,
             "weights": jax.ShapeDtypeStruct((B, T), np.float32)}
    grad = jax.jit(jax.grad(lambda p, b: step_lib.loss_sums(p, graphdef, b)[0]))
    return grad.lower(params, batch).compile().cost_analysis()["flops"]


def test_gemma4_flops_formula_agrees_with_xla_cost_analysis():
    """The same check on the Gemma 4 twin at tiny's widths: layers of two shapes (wide global ones
    whose keys are the values), sharing layers without k/v projections, per-layer embeddings, a
    double-wide MLP. XLA computes every layer's full T×T scores (sliding-window ones too) where the
    formula counts the causal half or the window band. The per-layer embeddings' part alone: the
    difference they make to XLA's count."""
    from maxlite.models.flops import forward_flops_by_part
    from maxlite.models.layout import attention_shape, pattern_mixers

    B, T = 2, 128
    argv = ["base.yml", "model_name=gemma4-tiny", "base_emb_dim=256", "base_mlp_dim=768", "head_dim=64",
            "global_head_dim=128", "per_layer_embed_dim=64", "per_device_batch_size=2", "max_target_length=128",
            "scan_layers=false", "remat_policy=none", "attention=dot_product", "num_vocab_tiling=1", "dtype=float32"]
    cfg = C.resolve(C.load(argv), 1)
    xla_flops = _xla_train_flops(cfg, B, T)
    N = cfg.base_num_query_heads
    full = sum(2 * attention_flops(B, T, N, attention_shape(cfg, v == "global")[1]) for _, v in pattern_mixers(cfg))
    expected = train_flops_per_step(cfg, batch_size=B) + 3 * (full - forward_flops_by_part(cfg, B)["attention"])
    assert xla_flops == pytest.approx(expected, rel=0.03), (xla_flops, expected)
    without = _xla_train_flops(C.resolve(C.load(argv + ["per_layer_embed_dim=0"]), 1), B, T)
    # the matmuls; XLA adds their norms and GELU (elementwise, ~6% here)
    assert xla_flops - without == pytest.approx(3 * forward_flops_by_part(cfg, B)["per_layer"], rel=0.1)


def test_attention_flops_are_the_causal_half_of_what_dot_product_computes():
    """dot_product computes the full T×S scores and PV: XLA's count is twice the causal formula,
    plus the softmax's few elementwise FLOPs per score."""
    from maxlite.models import attention

    B, T, N, K, H = 2, 256, 4, 2, 64
    q = jax.ShapeDtypeStruct((B, T, N, H), np.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, H), np.float32)
    seg = jax.ShapeDtypeStruct((B, T), np.int32)
    xla_flops = jax.jit(attention.dot_product).lower(q, kv, kv, seg).compile().cost_analysis()["flops"]
    assert xla_flops == pytest.approx(2 * attention_flops(B, T, N, H), rel=0.05), xla_flops


def test_attention_flops_count_a_local_layer_over_its_window_only():
    """Gemma 3's 5 local : 1 global at T = 1024, W = 128: the attention term is to six causal layers
    as the visible (query, key) pairs of an explicit mask are (the formula's T²/2 and T·W − W²/2
    leave out the diagonal's half, < 1%)."""
    from maxlite.models.flops import forward_flops_by_part

    T, W = 1024, 128
    cfg = tiny(decoder_block="gemma3", base_num_decoder_layers=6, sliding_window=W, max_target_length=T)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    causal, local = np.sum(j <= i), np.sum((j <= i) & (i - j < W))
    counted = forward_flops_by_part(cfg)["attention"]
    six_global = 6 * attention_flops(cfg.global_batch_size, T, cfg.base_num_query_heads, cfg.head_dim)
    assert counted / six_global == pytest.approx((5 * local + causal) / (6 * causal), rel=0.01)
    assert counted / six_global < 0.4  # the bands, not six triangles


def test_moe_flops_count_active_experts_only():
    """tiny-moe routes each token to 2 experts of half tiny's MLP width: its training FLOPs are
    tiny's plus the router's (3 × L × 2·tokens·D·E), whatever the number of experts."""
    tiny_cfg, moe_cfg = (C.load(["base.yml", f"model_name={m}"]) for m in ("tiny", "tiny-moe"))
    tokens = tiny_cfg.global_batch_size * tiny_cfg.max_target_length
    for experts in (8, 64):
        cfg = C.load(["base.yml", "model_name=tiny-moe", f"num_experts={experts}"])
        router = 3 * cfg.base_num_decoder_layers * 2 * tokens * cfg.base_emb_dim * experts
        assert train_flops_per_step(cfg) == train_flops_per_step(tiny_cfg) + router
    assert moe_cfg.num_experts_per_tok * moe_cfg.base_moe_mlp_dim == tiny_cfg.base_mlp_dim
