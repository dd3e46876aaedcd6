"""maxlite gemma3 params ↔ Hugging Face `Gemma3ForCausalLM` (`model_type: gemma3_text`), and with a
vision tower (vision_encoder=siglip) ↔ `Gemma3ForConditionalGeneration` (`model_type: gemma3`).

Tensor names are Llama's with Gemma's norms (hf_llama.decoder_maps, by trait). config.json
carries the layer pattern (`layer_types`: 5 `sliding_attention` to 1 `full_attention`), the window,
one RoPE per kind of layer (`rope_parameters.full_attention` / `.sliding_attention`; 4.x:
`rope_theta`, `rope_local_base_freq`, `rope_scaling`) and `query_pre_attn_scalar`.

Import also reads the multimodal checkpoints (`model_type: gemma3`, Gemma 3 4B/12B/27B on the
hub): the text model from `text_config` (whose absent keys take Gemma3TextConfig's defaults,
below) and its tensors under `language_model.model.` (transformers 4.x) or `model.language_model.`
(5.x). Its SigLIP tower and projector come along (unless `vision_encoder=` is given: the text model alone) (maxlite/models/vision/siglip_hf.py's table, under
whichever of its writers' prefixes the checkpoint has; SigLIP's pooling head, which Gemma 3 never runs,
is left behind): `vision_config`, `mm_tokens_per_image` and the image / boi / eoi token ids become the
vision keys, preprocessor_config.json's square size, mean and std the processor's. Export writes
the layout transformers 5's save_pretrained writes, and its preprocessor_config.json.
"""

from __future__ import annotations

import json
import pathlib

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, config_tail
from maxlite.bridge.vision_maps import siglip_maps
from maxlite.models.vision import siglip_hf

ACTIVATION = "gelu_pytorch_tanh"  # GeGLU: GELU's tanh approximation on the gate
# Gemma3TextConfig's defaults (transformers 5.x; checked by tests/test_bridge_hf_families.py):
# a multimodal config.json's text_config states only what differs from them
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                 "hidden_activation": ACTIVATION, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                 "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
                 "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                 "final_logit_softcapping": None, "attn_logit_softcapping": None}
PREFIXES = ("model.", "model.language_model.", "language_model.model.")  # the text decoder's, by writer
# the tower's and projector's, by writer (siglip_hf), with the decoder's prefix each writes beside it;
# export writes the first (transformers 5's save_pretrained)
VISION_LAYOUTS = ((siglip_hf.SAVED_5, "language_model.model."), (siglip_hf.IN_MEMORY, "model.language_model."),
                  (siglip_hf.HUB, "language_model.model."))
SKIPPED = ("language_model.lm_head.",)
HEAD = "head."  # SigLIP's pooling head under the tower's prefix: Gemma 3 reads the patch states, never it


def check_supported(cfg) -> None:
    if cfg.decoder_block != "gemma3":
        raise ValueError(f"decoder_block={cfg.decoder_block} is not gemma3")
    if cfg.vision_encoder not in ("", "siglip"):
        raise ValueError(f"decoder_block=gemma3 with vision_encoder={cfg.vision_encoder!r}: Gemma 3's encoder is siglip")


def peft_prefix(cfg) -> str:
    """Where the class holds the decoder's layers as modules (peft's names): with the tower,
    transformers 5's in-memory `model.language_model.`, not the `language_model.model.` it saves."""
    return VISION_LAYOUTS[1][1] if cfg.vision_encoder else "model."


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    if not cfg.vision_encoder:
        return hf_llama.decoder_maps(cfg)
    vision, text = VISION_LAYOUTS[0]
    return hf_llama.decoder_maps(cfg, text) + siglip_maps(cfg, vision)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    """The tensor table under whichever prefixes the checkpoint's writer used."""
    check_supported(cfg)
    prefix = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in names), "model.")
    if not cfg.vision_encoder:
        return hf_llama.decoder_maps(cfg, prefix)
    vision = next((v for v, _ in VISION_LAYOUTS if f"{v.vision}embeddings.patch_embedding.weight" in names), None)
    if vision is None:
        raise ValueError(f"config.json has a vision_config but no vision tower tensors were found under "
                         f"{', '.join(repr(v.vision) for v, _ in VISION_LAYOUTS)}")
    return hf_llama.decoder_maps(cfg, prefix) + siglip_maps(cfg, vision)


def skipped(cfg, names: set[str]) -> set[str]:
    """A multimodal checkpoint imported as its text model (`vision_encoder=` on the command line: the
    decoder alone, e.g. for a fused attention kernel): its tower's and projector's tensors stay behind."""
    if cfg.vision_encoder:
        return set()
    prefixes = tuple(p for v, _ in VISION_LAYOUTS for p in v)
    return {n for n in names if n.startswith(prefixes)}


def ignore(name: str) -> bool:
    return (hf_llama.ignore(name) or name.startswith(SKIPPED)
            or any(name.startswith(v.vision + HEAD) for v, _ in VISION_LAYOUTS))


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    """Gemma3ForCausalLM's config.json; with a tower, Gemma3ForConditionalGeneration's around it."""
    text = _text_config(cfg, dtype, bos_id, eos_id)
    if not cfg.vision_encoder:
        return text
    from maxlite.models.vision.towers import siglip_spec

    text.pop("architectures")
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
            "vision_config": siglip_spec(cfg).to_hf()["vision_config"],
            "mm_tokens_per_image": cfg.vision_tokens_per_image, "image_token_index": cfg.image_token_id,
            "boi_token_index": cfg.vision_start_token_id, "eoi_token_index": cfg.vision_end_token_id,
            "tie_word_embeddings": bool(cfg.logits_via_embedding), "dtype": dtype, "torch_dtype": dtype}


def _text_config(cfg, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    check_supported(cfg)
    from maxlite.models.layout import layer_windows

    out = hf_llama.common_config(cfg, "Gemma3ForCausalLM", "gemma3_text", dtype, bos_id, eos_id)
    global_rope, local_rope = hf_llama.rope_dict(cfg), hf_llama.rope_dict(cfg, local=True)
    out.update({
        "hidden_activation": ACTIVATION,
        "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar or cfg.head_dim),  # 5.x: an int
        "sliding_window": cfg.sliding_window or None,
        "layer_types": ["sliding_attention" if w else "full_attention" for w in layer_windows(cfg)],
        "rope_parameters": {"full_attention": global_rope, "sliding_attention": local_rope},
        "rope_local_base_freq": local_rope["rope_theta"],
        "attention_bias": bool(cfg.use_bias),
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        **config_tail(dtype, bos_id, eos_id),
    })
    return out


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def text_config(hf: dict) -> dict:
    """The text model's config.json keys, defaults filled (a multimodal config nests them)."""
    if hf.get("model_type") == "gemma3":
        text = hf.get("text_config") or {}
        return {**TEXT_DEFAULTS, "model_type": "gemma3_text", **text,
                **{k: hf[k] for k in ("dtype", "torch_dtype") if k in hf and k not in text}}
    return {**TEXT_DEFAULTS, **hf}


def config_overrides(hf: dict) -> dict:
    """The text model's keys; a multimodal checkpoint's tower, token ids and pooling besides."""
    vision = vision_overrides(hf) if hf.get("model_type") == "gemma3" else {}
    return {**_text_overrides(text_config(hf)), **vision}


def vision_overrides(hf: dict) -> dict:
    """A Gemma3Config's vision_config, mm_tokens_per_image and token ids → the vision keys (absent
    keys take Gemma3Config's and SiglipVisionConfig's defaults, as transformers fills them)."""
    from maxlite.models.vision.siglip import SiglipSpec

    vision = {**SIGLIP_DEFAULTS, **(hf.get("vision_config") or {})}
    top = {**MULTIMODAL_DEFAULTS, **{k: v for k, v in hf.items() if k in MULTIMODAL_DEFAULTS}}
    spec = SiglipSpec.from_hf({"vision_config": vision, "text_config": {"hidden_size": 0},
                               "mm_tokens_per_image": top["mm_tokens_per_image"]})
    if spec.num_channels != 3:
        raise ValueError(f"vision_config num_channels={spec.num_channels}: maxlite reads RGB images")
    return {"vision_encoder": "siglip", "vision_num_layers": spec.depth, "vision_emb_dim": spec.hidden_size,
            "vision_mlp_dim": spec.intermediate_size, "vision_num_heads": spec.num_heads,
            "vision_patch_size": spec.patch_size, "vision_image_size": spec.image_size,
            "vision_tokens_per_image": spec.mm_tokens_per_image, "vision_act": spec.hidden_act,
            "vision_norm_epsilon": spec.layer_norm_eps, "image_token_id": top["image_token_index"],
            "vision_start_token_id": top["boi_token_index"], "vision_end_token_id": top["eoi_token_index"]}


# transformers 5.x's defaults for what a multimodal config.json may leave out (SiglipVisionConfig's
# when Gemma3Config builds it, and Gemma3Config's own)
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6}
MULTIMODAL_DEFAULTS = {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
                       "image_token_index": 262_144}


def _text_overrides(hf: dict) -> dict:
    hf_llama.check_mlp(hf, ACTIVATION)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key):
            raise ValueError(f"config.json: {key}={hf[key]} (Gemma 2's softcapping) is not modelled by maxlite")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json: use_bidirectional_attention (an encoder) is not modelled by maxlite")
    rope = hf.get("rope_parameters") or {}
    if "full_attention" in rope:  # 5.x: one dict per kind of layer
        global_rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
    else:  # 4.x: rope_theta + rope_scaling for global layers, rope_local_base_freq for local ones
        global_rope = {**(hf.get("rope_scaling") or {}), "rope_theta": hf["rope_theta"]}
        local_rope = {"rope_type": "default", "rope_theta": hf["rope_local_base_freq"]}
    if local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: sliding-window layers with {local_rope['rope_type']} RoPE scaling are not "
                         f"modelled by maxlite (their RoPE is unscaled)")
    L = hf["num_hidden_layers"]
    if "layer_types" not in hf and "sliding_window_pattern" in hf:  # 4.x
        period = hf["sliding_window_pattern"]
        hf = {**hf, "layer_types": ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(L)]}
    windows = hf_llama.windows_of(hf, L)
    local_theta = local_rope.get("rope_theta", hf["rope_local_base_freq"])
    out = {**hf_llama.common_overrides({**hf, "rope_parameters": global_rope}, "gemma3"),
           "use_bias": bool(hf.get("attention_bias", False)), "sliding_window": max(windows),
           "local_rope_max_timescale": int(local_theta) if float(local_theta).is_integer() else local_theta,
           "query_pre_attn_scalar": float(hf["query_pre_attn_scalar"]), **hf_llama.pattern_keys("gemma3", windows)}
    if not out["sliding_window"]:
        out["local_rope_max_timescale"] = 0
    return out



PROCESSOR = "preprocessor_config.json"


def processor_overrides(hf_dir: str) -> dict:
    """preprocessor_config.json's normalisation (a multimodal checkpoint's; SigLIP's 0.5 defaults
    without one). Its square size must be the tower's image_size; pan-and-scan crops and another
    resample than bilinear are refused (maxlite/data/images.py resizes as Gemma3ImageProcessor does)."""
    folder = pathlib.Path(hf_dir)
    hf = json.loads((folder / "config.json").read_text())
    if hf.get("model_type") != "gemma3":
        return {}
    path = folder / PROCESSOR
    pre = json.loads(path.read_text()) if path.is_file() else {}
    image_size = {**SIGLIP_DEFAULTS, **(hf.get("vision_config") or {})}["image_size"]
    size = pre.get("size") or {"height": image_size, "width": image_size}
    if (size.get("height"), size.get("width")) != (image_size, image_size):
        raise ValueError(f"{path}: size {size} is not the vision tower's {image_size}×{image_size} image")
    if pre.get("do_pan_and_scan"):
        raise ValueError(f"{path}: do_pan_and_scan (Gemma 3's extra crops) is not modelled by maxlite")
    if pre.get("resample", 2) != 2:
        raise ValueError(f"{path}: resample={pre['resample']}: maxlite resizes bilinearly (2), as Gemma 3 does")
    return {"vision_image_size": image_size, "image_mean": tuple(pre.get("image_mean") or (0.5, 0.5, 0.5)),
            "image_std": tuple(pre.get("image_std") or (0.5, 0.5, 0.5))}


def write_processor(cfg, out: pathlib.Path) -> None:
    """preprocessor_config.json as transformers' Gemma3ImageProcessor reads it (a tower's model only)."""
    if not cfg.vision_encoder:
        return
    (out / PROCESSOR).write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "resample": 2,
        "do_pan_and_scan": False, "image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std),
        "size": {"height": cfg.vision_image_size, "width": cfg.vision_image_size}}, indent=2) + "\n")
