"""maxlite qwen3_vl params ↔ Hugging Face `Qwen3VLForConditionalGeneration`, and config.json both ways.

The decoder is Qwen3's (hf_llama.decoder_maps) under `model.language_model.`, its head `lm_head.`; the
vision tower's tensors (`model.visual.`) map through maxlite/models/vision/qwen_vit_hf.py. config.json
nests the decoder's keys in `text_config` (model_type qwen3_vl_text; `rope_parameters.mrope_section`
↔ mrope_sections) and the tower's in `vision_config`; the placeholder and marker token ids sit at the
top. The processor's pixel budget and normalisation come from preprocessor_config.json
(image_min_pixels, image_max_pixels, image_mean, image_std) and go back there on export.
"""

from __future__ import annotations

import json
import pathlib

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap
from maxlite.bridge.vision_maps import qwen_vit_maps
from maxlite.models.vision.qwen_vit import QwenVisionSpec
from maxlite.models.vision.towers import qwen_spec

PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."


def check_supported(cfg) -> None:
    if cfg.vision_encoder != "qwen_vit":
        raise ValueError(f"decoder_block=qwen3_vl with vision_encoder={cfg.vision_encoder!r}: Qwen3-VL's encoder "
                         "is qwen_vit")
    if cfg.use_bias:
        raise ValueError("use_bias=true: Qwen3-VL's decoder has no attention biases")
    if len(cfg.mrope_sections) != 3:
        raise ValueError(f"mrope_sections={list(cfg.mrope_sections)}: Qwen3-VL turns time, height and width "
                         "positions (3 sections)")
    hf_llama.check_plain_attention(cfg, "Qwen3VLForConditionalGeneration")


def tensor_maps(cfg) -> list[TensorMap]:
    check_supported(cfg)
    return hf_llama.decoder_maps(cfg, PREFIX) + qwen_vit_maps(cfg, VISION_PREFIX)


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg)


ignore = hf_llama.ignore


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    text = hf_llama.common_config(cfg, "Qwen3VLForConditionalGeneration", "qwen3_vl_text", dtype, bos_id, eos_id)
    text.pop("architectures")
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_sections),
                               "mrope_interleaved": True}
    text.update(hidden_act="silu", attention_bias=False)
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "text_config": text, "vision_config": qwen_spec(cfg).to_hf(),
            "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
            "vision_start_token_id": cfg.vision_start_token_id, "vision_end_token_id": cfg.vision_end_token_id,
            "tie_word_embeddings": bool(cfg.logits_via_embedding), "dtype": dtype, "torch_dtype": dtype}


def config_overrides(hf: dict) -> dict:
    if hf.get("model_type") != "qwen3_vl":
        raise ValueError(f"config.json model_type={hf.get('model_type')!r} is not qwen3_vl")
    text = {**hf["text_config"], "tie_word_embeddings": hf.get("tie_word_embeddings",
                                                                hf["text_config"].get("tie_word_embeddings", False))}
    hf_llama.check_mlp(text, "silu")
    if hf["vision_config"].get("out_hidden_size") != text["hidden_size"]:
        raise ValueError(f"config.json: vision out_hidden_size={hf['vision_config'].get('out_hidden_size')} is not "
                         f"the decoder's hidden_size={text['hidden_size']}")
    rope = text.get("rope_parameters") or {}
    if not rope.get("mrope_interleaved", True):
        raise ValueError("config.json: mrope_interleaved=false (Qwen2.5-VL's sectioned layout) is not modelled")
    return {**hf_llama.common_overrides(text, "qwen3_vl"), "use_bias": bool(text.get("attention_bias", False)),
            "mrope_sections": tuple(rope.get("mrope_section") or (24, 20, 20)),
            **vision_overrides(hf["vision_config"]),
            "image_token_id": hf["image_token_id"], "video_token_id": hf.get("video_token_id", -1),
            "vision_start_token_id": hf.get("vision_start_token_id", -1),
            "vision_end_token_id": hf.get("vision_end_token_id", -1)}


def vision_overrides(vision: dict) -> dict:
    """HF's vision_config → the vision encoder keys (its out_hidden_size is the decoder's width)."""
    spec = QwenVisionSpec.from_hf(vision)
    if spec.in_channels != 3:
        raise ValueError(f"vision_config in_channels={spec.in_channels}: maxlite reads RGB images")
    return {"vision_encoder": "qwen_vit", "vision_num_layers": spec.depth, "vision_emb_dim": spec.hidden_size,
            "vision_mlp_dim": spec.intermediate_size, "vision_num_heads": spec.num_heads,
            "vision_patch_size": spec.patch_size, "vision_temporal_patch_size": spec.temporal_patch_size,
            "vision_merge_size": spec.spatial_merge_size, "vision_num_positions": spec.num_position_embeddings,
            "vision_deepstack_layers": spec.deepstack_visual_indexes, "vision_act": spec.hidden_act}


PROCESSOR = "preprocessor_config.json"


def processor_overrides(hf_dir: str) -> dict:
    """The image processor's pixel budget and normalisation (preprocessor_config.json; transformers 5.x
    `size.shortest_edge` / `longest_edge`, 4.x `min_pixels` / `max_pixels`). A directory without one
    takes transformers' Qwen2VLImageProcessor defaults."""
    path = pathlib.Path(hf_dir) / PROCESSOR
    pre = json.loads(path.read_text()) if path.is_file() else {}
    size = pre.get("size") or {}
    return {"image_min_pixels": int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            "image_max_pixels": int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
            "image_mean": tuple(pre.get("image_mean") or (0.48145466, 0.4578275, 0.40821073)),
            "image_std": tuple(pre.get("image_std") or (0.26862954, 0.26130258, 0.27577711))}


def write_processor(cfg, out: pathlib.Path) -> None:
    """preprocessor_config.json as transformers' Qwen2VLImageProcessor reads it."""
    (out / PROCESSOR).write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "do_convert_rgb": True, "do_resize": True,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "resample": 3,
        "image_mean": list(cfg.image_mean), "image_std": list(cfg.image_std),
        "patch_size": cfg.vision_patch_size, "temporal_patch_size": cfg.vision_temporal_patch_size,
        "merge_size": cfg.vision_merge_size,
        "size": {"shortest_edge": cfg.image_min_pixels, "longest_edge": cfg.image_max_pixels}}, indent=2) + "\n")
