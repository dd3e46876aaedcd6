"""maxlite gpt3-block params ↔ Hugging Face `GPT2LMHeadModel` (config.json + safetensors).

maxlite's GPT-3 style block is GPT-2's: pre-LayerNorm, learned positions, biases everywhere,
tanh-approximated GELU (HF `gelu_new`), attention scaled by 1/sqrt(H). GPT-2 stores its linear
layers as `Conv1D` with weights [in, out] — maxlite's own layout, so kernels are not transposed;
q, k and v are one fused `c_attn` [D, 3·N·H] (q | k | v along the output axis).
"""

from __future__ import annotations

import numpy as np

from maxlite.bridge.hf_convert import TensorMap, config_tail, same

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are GELU's tanh approximation


def check_supported(cfg) -> None:
    N, K, H, D = cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim, cfg.base_emb_dim
    if N != K or N * H != D or not cfg.use_bias:
        raise ValueError(f"a GPT-2 export needs kv heads = heads, heads × head_dim = emb dim and "
                         f"use_bias=true; this model has N={N}, K={K}, H={H}, D={D}, use_bias={cfg.use_bias}")
    if cfg.sliding_window or cfg.query_pre_attn_scalar:
        raise ValueError("a GPT-2 export has no sliding window and scales attention by 1/sqrt(head_dim): "
                         "set sliding_window=0 and query_pre_attn_scalar=0")


def _qkv(hf: str, paths, D: int, NH: int, shape) -> TensorMap:
    """q, k, v leaves ↔ one fused tensor, concatenated along its last (output) axis."""
    lead = (D,) if len(shape) == 3 else ()
    return TensorMap(
        hf, paths, (*lead, 3 * NH), (shape,) * 3,
        lambda q, k, v: np.concatenate([x.reshape(*lead, NH) for x in (q, k, v)], axis=-1),
        lambda t: tuple(t[..., j * NH:(j + 1) * NH].reshape(shape) for j in range(3)))


def tensor_maps(cfg, prefix: str = "transformer.") -> list[TensorMap]:
    check_supported(cfg)
    D, N, H, F, V = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.head_dim, cfg.base_mlp_dim, cfg.vocab_size
    NH, h = N * H, prefix + "h.{i}."
    maps = [same(prefix + "wte.weight", ("embedding",), (V, D), layer=False),
            same(prefix + "wpe.weight", ("positions",), (cfg.max_position_embeddings, D), layer=False),
            same(prefix + "ln_f.weight", ("final_norm", "scale"), (D,), layer=False),
            same(prefix + "ln_f.bias", ("final_norm", "bias"), (D,), layer=False)]
    if not cfg.logits_via_embedding:
        maps.append(TensorMap("lm_head.weight", (("unembedding",),), (V, D), ((D, V),),
                              lambda w: w.T, lambda t: (t.T,), layer=False))
    return maps + [
        same(h + "ln_1.weight", ("attn_norm", "scale"), (D,)),
        same(h + "ln_1.bias", ("attn_norm", "bias"), (D,)),
        _qkv(h + "attn.c_attn.weight", (("attn", "q"), ("attn", "k"), ("attn", "v")), D, NH, (D, N, H)),
        _qkv(h + "attn.c_attn.bias", (("attn", "q_bias"), ("attn", "k_bias"), ("attn", "v_bias")), D, NH, (N, H)),
        same(h + "attn.c_proj.weight", ("attn", "o"), (N, H, D), (NH, D)),
        same(h + "attn.c_proj.bias", ("attn", "o_bias"), (D,)),
        same(h + "ln_2.weight", ("mlp_norm", "scale"), (D,)),
        same(h + "ln_2.bias", ("mlp_norm", "bias"), (D,)),
        same(h + "mlp.c_fc.weight", ("mlp", "up"), (D, F)),
        same(h + "mlp.c_fc.bias", ("mlp", "up_bias"), (F,)),
        same(h + "mlp.c_proj.weight", ("mlp", "down"), (F, D)),
        same(h + "mlp.c_proj.bias", ("mlp", "down_bias"), (D,)),
    ]


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    """The original GPT-2 checkpoints have no `transformer.` prefix."""
    return tensor_maps(cfg, prefix="" if "wte.weight" in names else "transformer.")


def ignore(name: str) -> bool:
    """Older GPT-2 checkpoints store the causal-mask buffers."""
    return name.endswith((".attn.bias", ".attn.masked_bias"))


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_position_embeddings,
        "n_ctx": cfg.max_position_embeddings,
        "n_embd": cfg.base_emb_dim,
        "n_layer": cfg.base_num_decoder_layers,
        "n_head": cfg.base_num_query_heads,
        "n_inner": cfg.base_mlp_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.normalization_layer_epsilon,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "initializer_range": cfg.init_scale,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(cfg.logits_via_embedding),
        **config_tail(dtype, bos_id, eos_id),
    }


def config_overrides(hf: dict) -> dict:
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json activation_function={act!r}: maxlite's GPT block uses the tanh "
                         f"GELU ({' or '.join(ACTIVATIONS)})")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("config.json: only 1/sqrt(head_dim) attention scaling is supported")
    D, N = hf["n_embd"], hf["n_head"]
    return {"decoder_block": "gpt3", "base_emb_dim": D, "base_num_decoder_layers": hf["n_layer"],
            "base_num_query_heads": N, "base_num_kv_heads": N, "head_dim": D // N,
            "base_mlp_dim": hf.get("n_inner") or 4 * D, "vocab_size": hf["vocab_size"],
            "max_position_embeddings": hf.get("n_positions", 1024),
            "normalization_layer_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
            "logits_via_embedding": bool(hf.get("tie_word_embeddings", True)), "use_bias": True,
            "rope_scaling_factor": 0.0}
