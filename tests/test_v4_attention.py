"""DeepSeek-V4's attention (maxlite/models/v4_attention.py): each layer type equals transformers'
DeepseekV4Attention of that type (cache=None: the whole sequence, as training runs it) given the same
random weights, with the RoPE and the sliding-window mask DeepseekV4Model builds, in float32; also with
YaRN on the compressed layers' RoPE (the sliding layers' stays unscaled). Row 1 ends in padding: only
real tokens are compared. WEIGHTS below is the map from transformers' names to maxlite's."""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B, T, PAD = 2, 40, 5  # row 1's last PAD tokens are padding
# 4 indexer heads, not 2: an entry every head's ReLU zeroes scores exactly 0, and torch and XLA break
# such ties at the top-k cut differently (the CSA case checks there is none)
D, N, H, Q, R, G, L, I, J = 64, 4, 32, 32, 8, 2, 16, 4, 16
WINDOW, CSA, HCA, TOPK = 8, 4, 8, 3
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]

# transformers' parameter (under self_attn.) → (maxlite's path, how the tensor is laid out in maxlite)
_T = np.transpose
WEIGHTS = {
    "q_a_proj.weight": ("q_a", _T),
    "q_a_norm.weight": ("q_a_norm.scale", None),
    "q_b_proj.weight": ("q_b", lambda w: w.T.reshape(Q, N, H)),
    "kv_proj.weight": ("kv", _T),
    "kv_norm.weight": ("kv_norm.scale", None),
    "o_a_proj.weight": ("o_a", lambda w: w.reshape(G, L, N * H // G).transpose(0, 2, 1)),
    "o_b_proj.weight": ("o_b", _T),
    "sinks": ("sinks", None),
}
COMPRESSOR = {
    "compressor.kv_proj.weight": ("compressor.kv", _T),
    "compressor.gate_proj.weight": ("compressor.gate", _T),
    "compressor.position_bias": ("compressor.position_bias", None),
    "compressor.kv_norm.weight": ("compressor.kv_norm.scale", None),
}
INDEXER = {
    "compressor.indexer.kv_proj.weight": ("indexer.kv", _T),
    "compressor.indexer.gate_proj.weight": ("indexer.gate", _T),
    "compressor.indexer.position_bias": ("indexer.position_bias", None),
    "compressor.indexer.kv_norm.weight": ("indexer.kv_norm.scale", None),
    "compressor.indexer.q_b_proj.weight": ("indexer.q_b", lambda w: w.T.reshape(Q, I, J)),
    "compressor.indexer.scorer.weights_proj.weight": ("indexer.weights_proj", _T),
}
MAPS = {"sliding_attention": WEIGHTS, "heavily_compressed_attention": {**WEIGHTS, **COMPRESSOR},
        "compressed_sparse_attention": {**WEIGHTS, **COMPRESSOR, **INDEXER}}


def _transformers(layer_type, rope_parameters):
    """(transformers' attention of that type with random weights, its config)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    config = DeepseekV4Config(
        vocab_size=64, hidden_size=D, num_attention_heads=N, head_dim=H, q_lora_rank=Q, partial_rotary_factor=R / H,
        sliding_window=WINDOW, compress_rates={"compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA},
        index_n_heads=I, index_head_dim=J, index_topk=TOPK, o_groups=G, o_lora_rank=L, num_hidden_layers=3,
        layer_types=TYPES, rope_parameters=rope_parameters, rms_norm_eps=1e-6, attn_implementation="eager")
    torch.manual_seed(0)
    attn = DeepseekV4Attention(config, TYPES.index(layer_type)).float().eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith(("sinks", "position_bias")):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return attn, config


def _maxlite(layer_type, attn, yarn):
    from flax import nnx

    from maxlite import config as C
    from maxlite.models import v4_attention

    keys = ["base.yml", "model_name=tiny", "dtype=float32", "weight_dtype=float32", f"base_emb_dim={D}",
            f"base_num_query_heads={N}", f"head_dim={H}", f"q_lora_rank={Q}", f"qk_rope_head_dim={R}",
            f"sliding_window={WINDOW}", "rope_max_timescale=10000", "compress_rope_max_timescale=160000",
            f"compress_rate_csa={CSA}", f"compress_rate_hca={HCA}", f"index_n_heads={I}", f"index_head_dim={J}",
            f"index_topk={TOPK}", f"o_groups={G}", f"o_lora_rank={L}", "normalization_layer_epsilon=1e-6"]
    if yarn:
        keys += ["rope_scaling_type=yarn", f"rope_scaling_factor={YARN['factor']}",
                 f"rope_original_max_position={YARN['original_max_position_embeddings']}"]
    cls = {"sliding_attention": v4_attention.SlidingAttention,
           "heavily_compressed_attention": v4_attention.HeavilyCompressedAttention,
           "compressed_sparse_attention": v4_attention.CompressedSparseAttention}[layer_type]
    with nnx.use_eager_sharding(False):
        module = cls(C.load(keys), rngs=nnx.Rngs(params=1))
    theirs = dict(attn.named_parameters())
    table = MAPS[layer_type]
    assert set(theirs) == set(table)  # every parameter of transformers' layer is mapped
    ours = {".".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    assert set(ours) == {path for path, _ in table.values()}  # and every one of ours is set
    for name, (path, layout) in table.items():
        w = theirs[name].detach().numpy()
        w = layout(w) if layout else w
        assert w.shape == ours[path][...].shape, (name, path)
        ours[path][...] = w
    return module


def _inputs():
    from transformers.masking_utils import create_sliding_window_causal_mask

    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(2))
    mask_2d = torch.ones(B, T, dtype=torch.long)
    mask_2d[1, T - PAD:] = 0
    return x, mask_2d, create_sliding_window_causal_mask


def _theirs(attn, config, x, mask_2d, make_mask):
    """DeepseekV4Attention's output as DeepseekV4Model calls it (its RoPE dict, its mask)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    position_ids = torch.arange(T)[None]
    rotary = DeepseekV4RotaryEmbedding(config)
    position_embeddings = {kind: rotary(x, position_ids=position_ids, layer_type=kind) for kind in ("main", "compress")}
    mask = make_mask(config=config, inputs_embeds=x, attention_mask=mask_2d, cache=None, position_ids=position_ids)
    assert isinstance(mask, torch.Tensor)  # a 4-D float mask, which the compressed entries' bias extends
    with torch.no_grad():
        out, _ = attn(x, position_embeddings=position_embeddings, position_ids=position_ids, attention_mask=mask)
    return out.numpy()


def _real(out_BTD):
    return np.concatenate([out_BTD[0], out_BTD[1, :T - PAD]])


def _ours(module, x, mask_2d):
    import jax.numpy as jnp

    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    return np.asarray(module(jnp.asarray(x.numpy()), positions, jnp.asarray(mask_2d.numpy(), jnp.int32)))


def _assert_no_tie_at_the_cut(module, x):
    """Where a query has more ended entries than it keeps, its TOPK-th best score is above the next."""
    import jax.numpy as jnp

    from maxlite.models import v4_attention

    x_BTD = jnp.asarray(x.numpy())
    q_BTQ = module.q_a_norm(x_BTD @ module.q_a[...])
    positions, segments = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32)
    wins = v4_attention.windows(positions, segments, CSA)
    scores = module.indexer.scores(module.indexer(x_BTD, wins), x_BTD, q_BTQ, positions, wins.seen(positions, segments, CSA))
    cut = np.sort(np.asarray(scores), axis=-1)[..., ::-1][..., TOPK - 1:TOPK + 1]
    more = np.isfinite(cut[..., 1])
    assert more.sum() > T and np.all(cut[more][:, 0] > cut[more][:, 1])


@pytest.mark.parametrize("layer_type, yarn", [(t, False) for t in TYPES] + [(t, True) for t in TYPES])
def test_each_layer_type_equals_transformers(layer_type, yarn):
    attn, config = _transformers(layer_type, YARN if yarn else None)
    module = _maxlite(layer_type, attn, yarn)
    x, mask_2d, make_mask = _inputs()
    theirs = _real(_theirs(attn, config, x, mask_2d, make_mask))
    np.testing.assert_allclose(_real(_ours(module, x, mask_2d)), theirs, rtol=1e-5, atol=1e-5)
    if layer_type == "compressed_sparse_attention":
        _assert_no_tie_at_the_cut(module, x)
        module.indexer.topk = T  # every ended entry instead of the indexer's choice: another answer
        assert np.max(np.abs(_real(_ours(module, x, mask_2d)) - theirs)) > 1e-2
