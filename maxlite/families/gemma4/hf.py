"""Gemma 4 (text; `model_type: gemma4_text`, and the text model of a multimodal `gemma4` checkpoint):
Gemma4ForCausalLM both ways. The layers: maxlite/models/gemma4.py.

The block is Gemma 3's sandwich (RMSNorm before and after attention and MLP, GeGLU, √d-scaled tied
embeddings, 5 sliding-window layers to 1 global) with Gemma 4's changes: plain RMSNorm scales (w,
stored from 1, not Gemma 3's 1 + w), q/k norms and a scale-free v norm, scores unscaled, global
layers of their own width (`global_head_dim`, `global_num_kv_heads`, keys as values with
`attention_k_eq_v`) and proportional RoPE, each layer's output times a stored `layer_scalar`, logits
soft-capped (c·tanh(z/c)); on the small models per-layer embeddings, key/value sharing in the last
layers and double-wide MLPs there.

With a `vision_config` (Gemma4ForConditionalGeneration) the vision tower and the multimodal
embedder come along (vision_encoder=gemma4_vit; maxlite/models/vision/gemma4_vit_hf.py's table),
unless `vision_encoder=` is given (the text model alone); the audio tower always stays behind (the
import says so in one line: `left_behind`). preprocessor_config.json's patch, pooling and soft-token
budget become the vision keys; export writes Gemma4ForConditionalGeneration and its
preprocessor_config.json.

config.json states the global layers' shape two ways: `global_head_dim` / `num_global_key_value_heads`
(the published checkpoints) or `per_layer_config` (transformers 5.24 writes it); both are read,
both written.
"""

from __future__ import annotations

import json
import pathlib

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, same
from maxlite.families.gemma4 import FAMILY
from maxlite.models.layout import attention_shape, hf_layer_types

ACTIVATION = "gelu_pytorch_tanh"
# Gemma4TextConfig's defaults (transformers 5.24; tests/test_gemma4.py checks them): a multimodal
# config.json's text_config states only what differs from them
TEXT_DEFAULTS = {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                 "hidden_activation": ACTIVATION, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": True, "attention_bias": False, "sliding_window": 512,
                 "final_logit_softcapping": None, "vocab_size_per_layer_input": 262_144,
                 "hidden_size_per_layer_input": 256, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
                 "enable_moe_block": False, "use_double_wide_mlp": False}
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
PREFIXES = ("model.", "model.language_model.")  # the text decoder's: Gemma4ForCausalLM's, Gemma4ForConditionalGeneration's
TOWERS = ("vision_config", "audio_config")
VISION = ("model.vision_tower.", "model.embed_vision.")  # the vision tower's and its embedder's tensors
AUDIO = ("model.audio_tower.", "model.embed_audio.")
# Gemma4VisionConfig's defaults (transformers 5.25): a config.json's vision_config states what differs
VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 12,
                   "num_key_value_heads": 12, "head_dim": 64, "hidden_activation": ACTIVATION, "rms_norm_eps": 1e-6,
                   "pooling_kernel_size": 3, "patch_size": 16, "position_embedding_size": 10 * 1024,
                   "use_clipped_linears": False, "standardize": False, "attention_bias": False,
                   "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}
# Gemma4Config's token ids and the processor's soft-token budget (Gemma4ImageProcessor's default)
MULTIMODAL_DEFAULTS = {"image_token_id": 258_880, "boi_token_id": 255_999, "eoi_token_id": 258_882}
SOFT_TOKENS = 280


def check_supported(cfg) -> None:
    if cfg.decoder_block not in (FAMILY.name, "gemma4_moe"):
        raise ValueError(f"decoder_block={cfg.decoder_block} is not gemma4")
    if cfg.use_bias:
        raise ValueError("use_bias=true: Gemma4ForCausalLM has no attention biases")
    if cfg.vision_encoder not in ("", "gemma4_vit"):
        raise ValueError(f"decoder_block={cfg.decoder_block} with vision_encoder={cfg.vision_encoder!r}: Gemma 4's "
                         f"encoder is gemma4_vit")


def tensor_maps(cfg, prefix: str | None = None) -> list[TensorMap]:
    """Every tensor in HF's naming; attention maps per mixer kind (each layer shape its own). With
    a vision tower the decoder sits where Gemma4ForConditionalGeneration holds it."""
    check_supported(cfg)
    if prefix is None:
        prefix = PREFIXES[1] if cfg.vision_encoder else PREFIXES[0]
    if cfg.vision_encoder:
        from maxlite.bridge.vision_maps import gemma4_vit_maps

        return _text_maps(cfg, prefix) + gemma4_vit_maps(cfg)
    return _text_maps(cfg, prefix)


def _text_maps(cfg, prefix: str) -> list[TensorMap]:
    D, N, F, V = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_mlp_dim, cfg.vocab_size
    layer = prefix + "layers.{i}."
    a, m = layer + "self_attn.", layer + "mlp."
    maps = hf_llama.head_maps(cfg, prefix)
    if cfg.per_layer_embed_dim:
        L, P = cfg.base_num_decoder_layers, cfg.per_layer_embed_dim
        maps += [same(prefix + "embed_tokens_per_layer.weight", ("per_layer", "embedding"),
                      (cfg.per_layer_vocab_size or V, L * P), layer=False),
                 linear(prefix + "per_layer_model_projection.weight", ("per_layer", "projection"), (D,), (L * P,),
                        layer=False),
                 same(prefix + "per_layer_projection_norm.weight", ("per_layer", "norm", "scale"), (P,), layer=False),
                 linear(layer + "per_layer_input_gate.weight", ("per_layer", "gate"), (D,), (P,)),
                 linear(layer + "per_layer_projection.weight", ("per_layer", "proj"), (P,), (D,)),
                 same(layer + "post_per_layer_input_norm.weight", ("per_layer", "norm", "scale"), (D,))]
    maps += [same(layer + name, (leaf, "scale"), (D,)) for name, leaf in (
        ("input_layernorm.weight", "attn_norm"), ("post_attention_layernorm.weight", "attn_post_norm"),
        ("post_feedforward_layernorm.weight", "mlp_post_norm"))]
    maps.append(same(layer + "layer_scalar", ("layer_scalar",), (1,)))
    for variant in ("local", "global"):
        K, H = attention_shape(cfg, variant == "global")
        for shared in (False, True):
            mixer = f"gemma4_{variant}{'_shared' if shared else ''}"
            own = [linear(a + "q_proj.weight", ("attn", "q"), (D,), (N, H)),
                   linear(a + "o_proj.weight", ("attn", "o"), (N, H), (D,)),
                   same(a + "q_norm.weight", ("attn", "q_norm", "scale"), (H,))]
            if not shared:
                own += [linear(a + "k_proj.weight", ("attn", "k"), (D,), (K, H)),
                        same(a + "k_norm.weight", ("attn", "k_norm", "scale"), (H,))]
                if not (variant == "global" and cfg.attention_k_eq_v):
                    own.append(linear(a + "v_proj.weight", ("attn", "v"), (D,), (K, H)))
            maps += [_of(t, mixer=mixer) for t in own]
    if cfg.num_experts:
        return maps + _moe_maps(cfg, layer)
    maps.append(same(layer + "pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), (D,)))
    for ffn, width in (("dense", F), ("dense_wide", 2 * F)):
        maps += [_of(linear(m + "gate_proj.weight", ("mlp", "gate"), (D,), (width,)), mlp=ffn),
                 _of(linear(m + "up_proj.weight", ("mlp", "up"), (D,), (width,)), mlp=ffn),
                 _of(linear(m + "down_proj.weight", ("mlp", "down"), (width,), (D,)), mlp=ffn)]
    return maps


def _moe_maps(cfg, layer: str) -> list[TensorMap]:
    """The MoE layer (maxlite.models.gemma4.MoEBlock): the dense MLP and its norms, the router, the
    experts stacked [E, ...] (gate and up fused in one HF tensor, gate first)."""
    import numpy as np

    D, F, E, I = cfg.base_emb_dim, cfg.base_mlp_dim, cfg.num_experts, cfg.base_moe_mlp_dim
    m = layer + "mlp."
    maps = [linear(m + "gate_proj.weight", ("mlp", "dense", "gate"), (D,), (F,)),
            linear(m + "up_proj.weight", ("mlp", "dense", "up"), (D,), (F,)),
            linear(m + "down_proj.weight", ("mlp", "dense", "down"), (F,), (D,)),
            linear(layer + "router.proj.weight", ("mlp", "experts", "router"), (D,), (E,)),
            same(layer + "router.scale", ("mlp", "router_scale"), (D,)),
            same(layer + "router.per_expert_scale", ("mlp", "expert_scale"), (E,)),
            TensorMap(layer + "experts.gate_up_proj", (("mlp", "experts", "gate"), ("mlp", "experts", "up")),
                      (E, 2 * I, D), ((E, D, I), (E, D, I)),
                      lambda g, u: np.concatenate([g.transpose(0, 2, 1), u.transpose(0, 2, 1)], axis=1),
                      lambda t: (t[:, :I].transpose(0, 2, 1), t[:, I:].transpose(0, 2, 1))),
            TensorMap(layer + "experts.down_proj", (("mlp", "experts", "down"),), (E, D, I), ((E, I, D),),
                      lambda d: d.transpose(0, 2, 1), lambda t: (t.transpose(0, 2, 1),))]
    maps += [same(layer + name, ("mlp", leaf, "scale"), (D,)) for name, leaf in (
        ("pre_feedforward_layernorm.weight", "dense_norm"), ("post_feedforward_layernorm_1.weight", "dense_post_norm"),
        ("pre_feedforward_layernorm_2.weight", "experts_norm"),
        ("post_feedforward_layernorm_2.weight", "experts_post_norm"))]
    return [_of(t, mlp="gemma4_moe") for t in maps]


def lora_shapes(cfg) -> dict[str, dict[str, tuple]]:
    """Mixer kind → (in, out) shapes of the kernels its layers have (PEFT export, maxlite/bridge/peft.py);
    a sharing layer's MLP is double-wide when asked."""
    D, N, F = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_mlp_dim
    out = {}
    for variant in ("local", "global"):
        K, H = attention_shape(cfg, variant == "global")
        for shared in (False, True):
            width = 2 * F if shared and cfg.use_double_wide_mlp else F
            kernels = {"q": ((D,), (N, H)), "o": ((N, H), (D,)), "gate": ((D,), (width,)), "up": ((D,), (width,)),
                       "down": ((width,), (D,))}
            if not shared:
                kernels["k"] = ((D,), (K, H))
                if not (variant == "global" and cfg.attention_k_eq_v):
                    kernels["v"] = ((D,), (K, H))
            out[f"gemma4_{variant}{'_shared' if shared else ''}"] = kernels
    return out


def _of(t: TensorMap, **only) -> TensorMap:
    import dataclasses
    return dataclasses.replace(t, **only)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    """The tensor table under whichever prefix the checkpoint's writer used."""
    prefix = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in names), "model.")
    return tensor_maps(cfg, prefix)


def ignore(name: str) -> bool:
    """The multimodal checkpoint's audio tower and embedder stay behind."""
    return hf_llama.ignore(name) or name.startswith(AUDIO)


def left_behind(names: set[str]) -> str | None:
    """The import's line for a checkpoint with an audio tower, which maxlite has no encoder for."""
    audio = sum(name.startswith(AUDIO) for name in names)
    return (f"its audio tower and audio embedder ({audio} tensors) stay behind: maxlite has no audio encoder, so "
            f"the model trains and answers on text and images, and an export writes no audio tower") if audio else None


def skipped(cfg, names: set[str]) -> set[str]:
    """A multimodal checkpoint imported as its text model (no vision_config, or `vision_encoder=` on
    the command line): its vision tower's and embedder's tensors stay behind."""
    return set() if cfg.vision_encoder else {n for n in names if n.startswith(VISION)}


def peft_prefix(cfg) -> str:
    """Where the class holds the decoder's layers as modules (peft's names)."""
    return PREFIXES[1] if cfg.vision_encoder else PREFIXES[0]


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """Gemma4ForCausalLM's config.json; with a tower, Gemma4ForConditionalGeneration's around it."""
    text = _text_config(cfg, dtype, bos_id, eos_id)
    if not cfg.vision_encoder:
        return text
    from maxlite.models.vision.towers import gemma4_spec

    text.pop("architectures")
    text.update(pad_token_id=cfg.pad_token_id, use_bidirectional_attention="vision" if cfg.vision_bidirectional else None)
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
            "vision_config": gemma4_spec(cfg).to_hf(), "audio_config": None, "image_token_id": cfg.image_token_id,
            "boi_token_id": cfg.vision_start_token_id, "eoi_token_id": cfg.vision_end_token_id,
            "tie_word_embeddings": bool(cfg.logits_via_embedding), "dtype": dtype}


def _text_config(cfg, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    check_supported(cfg)
    K, H = attention_shape(cfg, True)
    types = hf_layer_types(cfg)
    rope = {"sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(cfg.local_rope_max_timescale or cfg.rope_max_timescale)},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": cfg.global_rope_fraction,
                               "rope_theta": float(cfg.rope_max_timescale)}}
    out = hf_llama.common_config(cfg, "Gemma4ForCausalLM", "gemma4_text", dtype, bos_id, eos_id)
    for key in ("rope_theta", "rope_scaling"):
        out.pop(key)
    out.update({
        "hidden_activation": ACTIVATION, "sliding_window": cfg.sliding_window or cfg.max_target_length,
        "layer_types": types, "rope_parameters": rope, "attention_bias": False,
        "final_logit_softcapping": cfg.final_logit_softcapping or None, "use_bidirectional_attention": None,
        "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
        "hidden_size_per_layer_input": cfg.per_layer_embed_dim, "attention_k_eq_v": cfg.attention_k_eq_v,
        "num_kv_shared_layers": cfg.num_kv_shared_layers, "use_double_wide_mlp": cfg.use_double_wide_mlp,
        "enable_moe_block": bool(cfg.num_experts), "global_head_dim": H,
        **({"num_experts": cfg.num_experts, "top_k_experts": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.base_moe_mlp_dim} if cfg.num_experts else {}), "num_global_key_value_heads": K,
        "per_layer_config": {str(i): {"head_dim": H, "num_key_value_heads": K}
                             for i, t in enumerate(types) if t == "full_attention"},
        **config_tail(dtype, bos_id, eos_id)})
    return out


def text_config(hf: dict) -> dict:
    """The text model's config.json keys, defaults filled. A multimodal checkpoint nests them in
    text_config; its towers are not a causal LM: a config without text_config is refused."""
    if hf.get("model_type") == "gemma4":
        if not hf.get("text_config"):
            towers = [k for k in TOWERS if hf.get(k)]
            raise ValueError(f"config.json: model_type gemma4 without a text_config ({', '.join(towers) or 'no tower'} "
                             f"only): maxlite imports Gemma 4's text model as a causal LM, and it is missing")
        text = hf["text_config"]
        return {**TEXT_DEFAULTS, "model_type": "gemma4_text", **text,
                **{k: hf[k] for k in ("dtype", "torch_dtype") if k in hf and k not in text}}
    if hf.get("model_type") != "gemma4_text":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r}: a Gemma 4 tower (gemma4_vision, "
                         f"gemma4_audio) is not a causal LM; import a gemma4 or gemma4_text checkpoint")
    return {**TEXT_DEFAULTS, **hf}


def _global_shape(hf: dict) -> tuple[int, int]:
    """(head dim, kv heads) of the full-attention layers, from per_layer_config or the global keys."""
    per_layer = hf.get("per_layer_config") or {}
    full = [i for i, t in enumerate(hf["layer_types"]) if t == "full_attention"]
    local = {str(i) for i in range(hf["num_hidden_layers"])} - {str(i) for i in full}
    if per_layer:
        overrides = [per_layer.get(str(i), per_layer.get(i, {})) for i in full]
        if any(per_layer.get(i) for i in local) or any(o != overrides[0] for o in overrides):
            raise ValueError("config.json: per_layer_config other than one shape for every full-attention layer "
                             "is not Gemma 4's layer")
        o = overrides[0] if overrides else {}
        return o.get("head_dim", hf["head_dim"]), o.get("num_key_value_heads", hf["num_key_value_heads"])
    kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
    return hf.get("global_head_dim", 512), kv or hf["num_key_value_heads"]


def config_overrides(hf: dict) -> dict:
    """The text model's keys; a multimodal checkpoint's vision tower and token ids besides."""
    vision = vision_overrides(hf) if hf.get("model_type") == "gemma4" and hf.get("vision_config") else {}
    return {**_text_overrides(hf), **vision}


def vision_overrides(hf: dict) -> dict:
    """A Gemma4Config's vision_config, token ids and the text model's pad token and image attention →
    the vision keys (absent keys take transformers' defaults; the soft-token budget the processor's
    default until preprocessor_config.json says, `processor_overrides`)."""
    from maxlite.models.vision.gemma4_vit import Gemma4VisionSpec

    vision = {**VISION_DEFAULTS, **hf["vision_config"]}
    if vision.get("attention_bias"):
        raise ValueError("vision_config attention_bias=true is not Gemma 4's tower")
    text = text_config(hf)
    spec = Gemma4VisionSpec.from_hf(vision, text["hidden_size"], SOFT_TOKENS)
    top = {**MULTIMODAL_DEFAULTS, **{k: v for k, v in hf.items() if k in MULTIMODAL_DEFAULTS}}
    return {"vision_encoder": "gemma4_vit", "vision_num_layers": spec.depth, "vision_emb_dim": spec.hidden_size,
            "vision_mlp_dim": spec.intermediate_size, "vision_num_heads": spec.num_heads,
            "vision_num_kv_heads": spec.num_kv_heads, "vision_head_dim": spec.head_dim,
            "vision_patch_size": spec.patch_size, "vision_pool_size": spec.pool,
            "vision_num_positions": spec.position_table, "vision_tokens_per_image": spec.max_soft_tokens,
            "vision_rope_theta": spec.rope_theta, "vision_norm_epsilon": spec.rms_norm_eps,
            "vision_act": spec.hidden_act, "vision_standardize": spec.standardize, "vision_clipped": spec.clipped,
            "vision_bidirectional": text.get("use_bidirectional_attention") == "vision",
            "pad_token_id": text.get("pad_token_id", 0), "image_token_id": top["image_token_id"],
            "vision_start_token_id": top["boi_token_id"], "vision_end_token_id": top["eoi_token_id"],
            "image_mean": (0.0, 0.0, 0.0), "image_std": (1.0, 1.0, 1.0)}


def _text_overrides(hf: dict) -> dict:
    hf = text_config(hf)
    hf_llama.check_mlp(hf, ACTIVATION)
    for key, why in (("use_bidirectional_attention", "bidirectional attention"), ("attention_bias", "biases")):
        if hf.get(key) and not (key == "use_bidirectional_attention" and hf[key] == "vision"):
            raise ValueError(f"config.json: {key}={hf[key]} ({why}) is not modelled by maxlite's gemma4 yet")
    L = hf["num_hidden_layers"]
    if "layer_types" not in hf:
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)]}
    if hf["layer_types"][-1] != "full_attention":  # transformers forces it (Gemma4TextConfig)
        hf = {**hf, "layer_types": [*hf["layer_types"][:-1], "full_attention"]}
    rope = {**DEFAULT_ROPE, **(hf.get("rope_parameters") or {})}
    local, full = rope["sliding_attention"], rope["full_attention"]
    if local.get("rope_type", "default") != "default" or float(full.get("factor", 1.0)) != 1.0 or \
            full.get("rope_type", "default") not in ("default", "proportional"):
        raise ValueError(f"config.json: RoPE {rope} is not Gemma 4's (default local, proportional global, factor 1)")
    fraction = float(full.get("partial_rotary_factor", 1.0)) if full.get("rope_type") == "proportional" else 1.0
    shared = hf.get("num_kv_shared_layers") or 0
    first_shared = L - shared
    if shared and set(hf["layer_types"][first_shared:]) - set(hf["layer_types"][:first_shared]):
        raise ValueError("config.json: a key/value-sharing layer has no earlier layer of its kind to share with")
    head_dim, kv = _global_shape(hf)
    windows = hf_llama.windows_of(hf, L)
    out = {**hf_llama.common_overrides({**hf, "rope_parameters": {}, "rope_theta": full["rope_theta"]}, FAMILY.name),
           "use_bias": False, "sliding_window": max(windows),
           "local_rope_max_timescale": _number(local.get("rope_theta", 10_000.0)),
           "global_head_dim": head_dim, "global_num_kv_heads": kv,
           "attention_k_eq_v": bool(hf.get("attention_k_eq_v")), "global_rope_fraction": fraction,
           "num_kv_shared_layers": shared, "use_double_wide_mlp": bool(hf.get("use_double_wide_mlp")),
           "per_layer_embed_dim": hf.get("hidden_size_per_layer_input") or 0,
           "per_layer_vocab_size": (hf.get("vocab_size_per_layer_input") or 0) if hf.get("hidden_size_per_layer_input") else 0,
           "final_logit_softcapping": float(hf.get("final_logit_softcapping") or 0.0),
           # the variant is the layer's shape here, not only its window: always recorded
           "layer_types": list(hf["layer_types"])}
    if hf.get("enable_moe_block") and hf.get("use_double_wide_mlp") and shared:
        raise ValueError("config.json: use_double_wide_mlp with enable_moe_block (double-wide dense MLPs beside "
                         "experts) is not modelled by maxlite's gemma4")
    if hf.get("enable_moe_block"):  # every layer: the dense MLP beside the experts
        out.update(decoder_block="gemma4_moe", num_experts=hf["num_experts"], num_experts_per_tok=hf["top_k_experts"],
                   base_moe_mlp_dim=hf["moe_intermediate_size"], norm_topk_prob=True, first_num_dense_layers=0,
                   interleave_moe_layer_step=1)
    if not out["sliding_window"]:  # no sliding-window layer: no local RoPE
        out["local_rope_max_timescale"] = 0
    if out["per_layer_vocab_size"] == out["vocab_size"]:
        out["per_layer_vocab_size"] = 0
    return out


PROCESSOR = "preprocessor_config.json"


def processor_overrides(hf_dir: str) -> dict:
    """preprocessor_config.json (a multimodal checkpoint's; Gemma4ImageProcessor's defaults without
    one): its soft-token budget and normalisation. Its patch and pooling must be the tower's; another
    resample than bicubic is refused (maxlite/data/images.py resizes as Gemma4ImageProcessorPil does)."""
    folder = pathlib.Path(hf_dir)
    hf = json.loads((folder / "config.json").read_text())
    if hf.get("model_type") != "gemma4" or not hf.get("vision_config"):
        return {}
    from maxlite.models.vision.gemma4_vit import SOFT_TOKEN_BUDGETS

    path = folder / PROCESSOR
    pre = json.loads(path.read_text()) if path.is_file() else {}
    vision = {**VISION_DEFAULTS, **hf["vision_config"]}
    for ours, theirs in (("patch_size", "patch_size"), ("pooling_kernel_size", "pooling_kernel_size")):
        if pre.get(theirs, vision[ours]) != vision[ours]:
            raise ValueError(f"{path}: {theirs}={pre[theirs]} is not the vision tower's {vision[ours]}")
    budget = pre.get("max_soft_tokens", SOFT_TOKENS)
    if budget not in SOFT_TOKEN_BUDGETS:
        raise ValueError(f"{path}: max_soft_tokens={budget} is not one of Gemma 4's {SOFT_TOKEN_BUDGETS}")
    if pre.get("resample", 3) != 3:
        raise ValueError(f"{path}: resample={pre['resample']}: maxlite resizes bicubically (3), as Gemma 4 does")
    if pre.get("do_rescale", True) is False or abs(pre.get("rescale_factor", 1 / 255) - 1 / 255) > 1e-12:
        raise ValueError(f"{path}: pixels not rescaled by 1/255 are not Gemma 4's")
    normalize = pre.get("do_normalize", False)
    return {"vision_tokens_per_image": budget,
            "image_mean": tuple(pre.get("image_mean") or (0.0,) * 3) if normalize else (0.0, 0.0, 0.0),
            "image_std": tuple(pre.get("image_std") or (1.0,) * 3) if normalize else (1.0, 1.0, 1.0)}


def write_processor(cfg, out: pathlib.Path) -> None:
    """preprocessor_config.json as transformers' Gemma4ImageProcessor reads it (a tower's model only)."""
    if not cfg.vision_encoder:
        return
    normalize = tuple(cfg.image_mean) != (0.0, 0.0, 0.0) or tuple(cfg.image_std) != (1.0, 1.0, 1.0)
    (out / PROCESSOR).write_text(json.dumps({
        "image_processor_type": "Gemma4ImageProcessor", "do_convert_rgb": True, "do_resize": True,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": normalize, "resample": 3,
        "image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std), "patch_size": cfg.vision_patch_size,
        "pooling_kernel_size": cfg.vision_pool_size, "max_soft_tokens": cfg.vision_tokens_per_image}, indent=2) + "\n")
