"""Qwen3.5 (dense; `model_type: qwen3_5_text`, Qwen3_5ForCausalLM): three gated delta-net layers to
one full-attention layer, both ways; the tensor and config.json maps the Qwen3.5-MoE and Qwen3-Next
modules share. A multimodal checkpoint (`model_type: qwen3_5`, Qwen3_5ForConditionalGeneration: the
published ones; Qwen3.5-MoE's alike) imports with its vision tower: the decoder's tensors under
`model.language_model.`, the qwen_vit tower's (no DeepStack) under `model.visual.`
(maxlite/bridge/vision_maps.py), `text_config.rope_parameters.mrope_section` ↔ mrope_sections (its
attention layers turn time, height and width positions), the image processor's files as Qwen3-VL's
(maxlite/families/qwen3_vl/hf.py); the export writes the same class again. A text-only checkpoint
stays a text model (vision_encoder "").

The layer: a (1 + w) RMSNorm before each branch (stored from 0), the mixer — a gated delta-net
(maxlite/models/gated_deltanet.py) or full attention with per-head (1 + w) q/k norms, partial RoPE
(`partial_rotary_factor` of each head's dims) and an output gate, sigmoid(x · q_gate), from the second
half of each head's rows of HF's doubled q_proj —, a SwiGLU MLP. HF's tensors:

  self_attn.q_proj [N·2H, D]: head n's query rows then its gate rows  ↔ attn.q, attn.q_gate [D, N, H]
  linear_attn.in_proj_qkv [2·J·E + M·U, D]  ↔ attn.q [D, J, E], attn.k [D, J, E], attn.v [D, M, U]
  linear_attn.in_proj_z / in_proj_b / in_proj_a  ↔ attn.z [D, M, U], attn.b / attn.a [D, M]
  linear_attn.conv1d.weight [2·J·E + M·U, 1, W]  ↔ attn.conv_q / conv_k / conv_v [W, heads, dim]
  linear_attn.A_log, dt_bias [M], norm.weight [U], out_proj [D, M·U]  ↔ attn.A_log, dt_bias,
    norm_scale, o [M, U, D]
(Qwen3-Next fuses q, k, v, z into in_proj_qkvz and b, a into in_proj_ba, grouped by key head:
`fused=True`.) The gated norm of the delta-net scales by w itself (stored from 1).
"""

from __future__ import annotations

import types

import numpy as np

from maxlite.bridge import hf_llama
from maxlite.bridge.hf_convert import TensorMap, config_tail, linear, same
from maxlite.families.qwen3_5 import FAMILY
from maxlite.models.layout import check_layer_types, hf_layer_types


GDN = "gated_deltanet"
# a multimodal checkpoint (Qwen3_5[Moe]ForConditionalGeneration: the published ones) → its text model's
# model_type; its decoder's tensors sit under model.language_model., its vision tower's under model.visual.
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
PREFIXES = ("model.", "model.language_model.")
TEXT_PREFIX, VISION_PREFIX = PREFIXES[1], "model.visual."


def check_supported(cfg, name: str = "Qwen3.5") -> None:
    if cfg.use_bias:
        raise ValueError(f"use_bias=true: {name} has no attention biases")
    if cfg.sliding_window:
        raise ValueError(f"sliding_window={cfg.sliding_window}: {name}'s attention layers are global")
    hf_llama.check_plain_attention(cfg, name)
    if cfg.vision_encoder and cfg.vision_encoder != "qwen_vit":
        raise ValueError(f"vision_encoder={cfg.vision_encoder!r}: {name}'s vision tower is qwen_vit")
    if cfg.vision_encoder and cfg.vision_deepstack_layers:
        raise ValueError(f"vision_deepstack_layers={list(cfg.vision_deepstack_layers)}: {name}'s vision tower has "
                         "no DeepStack")
    if cfg.vision_encoder and len(cfg.mrope_sections) != 3:
        raise ValueError(f"mrope_sections={list(cfg.mrope_sections)}: {name} with images turns time, height and "
                         "width positions (3 sections)")


def _gated_q(a: str, D: int, N: int, H: int) -> TensorMap:
    """HF's doubled q_proj [N·2H, D] (per head: H query rows, H gate rows) ↔ q, q_gate [D, N, H]."""
    return TensorMap(a + "q_proj.weight", (("attn", "q"), ("attn", "q_gate")),
                     (N * 2 * H, D), ((D, N, H), (D, N, H)),
                     lambda q, g: np.stack([q, g], axis=2).reshape(D, N * 2 * H).T,
                     lambda t: tuple(np.moveaxis(t.T.reshape(D, N, 2, H), 2, 0)), mixer="attention")


def _concat(name: str, paths, shapes, D: int, mixer: str = GDN) -> TensorMap:
    """One HF nn.Linear [Σ out, D] ↔ several kernels [D, *out_i] side by side."""
    sizes = [int(np.prod(s)) for s in shapes]
    cuts = np.cumsum(sizes)[:-1]
    return TensorMap(name, tuple(paths), (sum(sizes), D), tuple((D, *s) for s in shapes),
                     lambda *ws: np.concatenate([w.reshape(D, -1) for w in ws], axis=1).T,
                     lambda t: tuple(p.T.reshape(D, *s) for p, s in zip(np.split(t, cuts, axis=0), shapes)),
                     mixer=mixer)


def _fused(name: str, paths, shapes, D: int, J: int) -> TensorMap:
    """Qwen3-Next's fused projections [J·Σ out_i, D], grouped by key head: head j's rows of each
    kernel in turn (kernels [D, J·…] seen as [D, J, …])."""
    sizes = [int(np.prod(s)) // J for s in shapes]
    cuts = np.cumsum(sizes)[:-1]

    def to_hf(*ws):
        return np.concatenate([w.reshape(D, J, -1) for w in ws], axis=2).reshape(D, -1).T

    def from_hf(t):
        parts = np.split(t.T.reshape(D, J, sum(sizes)), cuts, axis=2)
        return tuple(p.reshape(D, *s) for p, s in zip(parts, shapes))
    return TensorMap(name, tuple(paths), (J * sum(sizes), D), tuple((D, *s) for s in shapes), to_hf, from_hf,
                     mixer=GDN)


def _conv(name: str, J: int, M: int, E: int, U: int, W: int) -> TensorMap:
    """conv1d.weight [C, 1, W] (channels: q, then k, then v) ↔ conv_q, conv_k [W, J, E], conv_v [W, M, U]."""
    shapes = ((W, J, E), (W, J, E), (W, M, U))
    cuts = np.cumsum([J * E, J * E])
    return TensorMap(name, (("attn", "conv_q"), ("attn", "conv_k"), ("attn", "conv_v")), (2 * J * E + M * U, 1, W),
                     shapes, lambda *ws: np.concatenate([w.reshape(W, -1) for w in ws], axis=1).T[:, None, :],
                     lambda t: tuple(p.T.reshape(s) for p, s in zip(np.split(t[:, 0, :], cuts, axis=0), shapes)),
                     mixer=GDN)


def hybrid_maps(cfg, fused: bool = False, prefix: str = "model.") -> list[TensorMap]:
    """Every tensor of a Qwen3.5 / Qwen3-Next decoder but the MLP's (`model.layers.{i}.mlp.*`), the
    decoder's under `prefix`."""
    D, N, K, H, V = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim, cfg.vocab_size
    J, M, E, U, W = (cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim,
                     cfg.gdn_value_head_dim, cfg.gdn_conv_kernel_dim)
    layer = prefix + "layers.{i}."
    a, g = layer + "self_attn.", layer + "linear_attn."
    maps = [same(prefix + "embed_tokens.weight", ("embedding",), (V, D), layer=False),
            same(prefix + "norm.weight", ("final_norm", "scale"), (D,), layer=False),
            same(layer + "input_layernorm.weight", ("attn_norm", "scale"), (D,)),
            same(layer + "post_attention_layernorm.weight", ("mlp_norm", "scale"), (D,))]
    if not cfg.logits_via_embedding:
        maps.append(linear("lm_head.weight", ("unembedding",), (D,), (V,), layer=False))
    attention = [_gated_q(a, D, N, H),
                 linear(a + "k_proj.weight", ("attn", "k"), (D,), (K, H)),
                 linear(a + "v_proj.weight", ("attn", "v"), (D,), (K, H)),
                 linear(a + "o_proj.weight", ("attn", "o"), (N, H), (D,)),
                 same(a + "q_norm.weight", ("attn", "q_norm", "scale"), (H,)),
                 same(a + "k_norm.weight", ("attn", "k_norm", "scale"), (H,))]
    if fused:
        projections = [_fused(g + "in_proj_qkvz.weight", [("attn", x) for x in "qkvz"],
                              [(J, E), (J, E), (M, U), (M, U)], D, J),
                       _fused(g + "in_proj_ba.weight", [("attn", "b"), ("attn", "a")], [(M,), (M,)], D, J)]
    else:
        projections = [_concat(g + "in_proj_qkv.weight", [("attn", "q"), ("attn", "k"), ("attn", "v")],
                               [(J, E), (J, E), (M, U)], D),
                       linear(g + "in_proj_z.weight", ("attn", "z"), (D,), (M, U)),
                       linear(g + "in_proj_b.weight", ("attn", "b"), (D,), (M,)),
                       linear(g + "in_proj_a.weight", ("attn", "a"), (D,), (M,))]
    deltanet = projections + [
        _conv(g + "conv1d.weight", J, M, E, U, W),
        same(g + "A_log", ("attn", "A_log"), (M,)),
        same(g + "dt_bias", ("attn", "dt_bias"), (M,)),
        same(g + "norm.weight", ("attn", "norm_scale"), (U,)),
        linear(g + "out_proj.weight", ("attn", "o"), (M, U), (D,))]
    return (maps + [t if t.mixer else _with(t, "attention") for t in attention]
            + [t if t.mixer else _with(t, GDN) for t in deltanet])


def _with(t: TensorMap, mixer: str) -> TensorMap:
    import dataclasses
    return dataclasses.replace(t, mixer=mixer)


def mlp_maps(cfg, prefix: str = "model.") -> list[TensorMap]:
    D, F, m = cfg.base_emb_dim, cfg.base_mlp_dim, prefix + "layers.{i}.mlp."
    return [linear(m + "gate_proj.weight", ("mlp", "gate"), (D,), (F,)),
            linear(m + "up_proj.weight", ("mlp", "up"), (D,), (F,)),
            linear(m + "down_proj.weight", ("mlp", "down"), (F,), (D,))]


def tensor_maps(cfg, prefix: str | None = None) -> list[TensorMap]:
    check_supported(cfg)
    prefix = prefix or default_prefix(cfg)
    return hybrid_maps(cfg, prefix=prefix) + mlp_maps(cfg, prefix) + vision_maps(cfg)


def default_prefix(cfg) -> str:
    """Where an export writes the decoder: under the multimodal class's language model with a vision tower."""
    return TEXT_PREFIX if cfg.vision_encoder else "model."


def vision_maps(cfg) -> list[TensorMap]:
    """The qwen_vit tower's tensors (none for a text model)."""
    if not cfg.vision_encoder:
        return []
    from maxlite.bridge.vision_maps import qwen_vit_maps
    return qwen_vit_maps(cfg, VISION_PREFIX)


def decoder_prefix(names: set[str]) -> str:
    """Where the checkpoint's writer put the decoder's tensors."""
    return next((p for p in PREFIXES[::-1] if f"{p}embed_tokens.weight" in names), "model.")


def import_maps(cfg, names: set[str]) -> list[TensorMap]:
    return tensor_maps(cfg, decoder_prefix(names))


def ignore(name: str) -> bool:
    """Multi-token-prediction heads (`mtp.*`) ride along in published checkpoints; maxlite trains none."""
    return name.startswith("mtp.") or hf_llama.ignore(name)


def text_config(hf: dict) -> dict:
    """The text model's config.json keys (a multimodal config nests them in text_config)."""
    if hf.get("model_type") not in MULTIMODAL:
        return hf
    text = hf.get("text_config") or {}
    return {**text, "model_type": MULTIMODAL[hf["model_type"]],
            **{k: hf[k] for k in ("dtype", "torch_dtype", "tie_word_embeddings") if k in hf and k not in text}}


# ---- config.json, both ways ----

def hybrid_config(cfg, architecture: str, model_type: str, dtype: str, bos_id, eos_id) -> dict:
    """The config.json keys Qwen3.5 and Qwen3-Next share."""
    # stated even when 1: transformers takes a missing factor for 0.25
    rope = {**hf_llama.rope_dict(cfg), "partial_rotary_factor": cfg.partial_rotary_factor}
    return {**hf_llama.common_config(cfg, architecture, model_type, dtype, bos_id, eos_id),
            "hidden_act": "silu", "attention_bias": False, "rope_parameters": rope, "rope_scaling": None,
            "layer_types": hf_layer_types(cfg), "linear_conv_kernel_dim": cfg.gdn_conv_kernel_dim,
            "linear_key_head_dim": cfg.gdn_key_head_dim, "linear_value_head_dim": cfg.gdn_value_head_dim,
            "linear_num_key_heads": cfg.gdn_num_key_heads, "linear_num_value_heads": cfg.gdn_num_value_heads,
            **config_tail(dtype, bos_id, eos_id)}


def hf_config(cfg, dtype: str = "float32", bos_id: int | None = None, eos_id: int | None = None) -> dict:
    check_supported(cfg)
    text = hybrid_config(cfg, "Qwen3_5ForCausalLM", "qwen3_5_text", dtype, bos_id, eos_id)
    return multimodal_config(cfg, text, "qwen3_5") if cfg.vision_encoder else text


def multimodal_config(cfg, text: dict, model_type: str) -> dict:
    """A vision model's config.json: Qwen3_5[Moe]ForConditionalGeneration with the text model's keys
    (`text`, its M-RoPE sections added) in text_config and the tower's in vision_config."""
    import dataclasses

    from maxlite.models.vision.towers import qwen_spec

    text = {k: v for k, v in text.items() if k != "architectures"}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_sections),
                               "mrope_interleaved": True}
    vision = dataclasses.replace(qwen_spec(cfg), model_type="qwen3_5_vision").to_hf()
    architecture = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
    return {"architectures": [architecture[model_type]], "model_type": model_type, "text_config": text,
            "vision_config": {**vision, "model_type": f"{model_type}_vision"},
            "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
            "vision_start_token_id": cfg.vision_start_token_id, "vision_end_token_id": cfg.vision_end_token_id,
            "tie_word_embeddings": bool(cfg.logits_via_embedding), "dtype": text["dtype"], "torch_dtype": text["dtype"]}


def hybrid_overrides(hf: dict, decoder_block: str) -> dict:
    """config.json → the maxlite keys Qwen3.5 and Qwen3-Next share."""
    hf_llama.check_mlp(hf, "silu")
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true is not Qwen3.5's attention")
    rope = dict(hf.get("rope_parameters") or {})
    L = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0 else "linear_attention"
        for i in range(L)]
    problem = check_layer_types(layer_types, L)
    if problem:
        raise ValueError(f"config.json: {problem}")
    # a text model's M-RoPE sections rotate its one position alike: plain RoPE
    out = {**hf_llama.common_overrides(hf, decoder_block), "use_bias": False,
           "partial_rotary_factor": float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
           "gdn_conv_kernel_dim": hf.get("linear_conv_kernel_dim", 4),
           "gdn_key_head_dim": hf.get("linear_key_head_dim", 128),
           "gdn_value_head_dim": hf.get("linear_value_head_dim", 128),
           "gdn_num_key_heads": hf.get("linear_num_key_heads", 16),
           "gdn_num_value_heads": hf.get("linear_num_value_heads", 32)}
    shape = types.SimpleNamespace(decoder_block=decoder_block, layer_types=(), base_num_decoder_layers=L,
                                  sliding_window=0, first_num_dense_layers=0, interleave_moe_layer_step=1,
                                  attention_type="global")
    if hf_layer_types(shape) != list(layer_types):  # a checkpoint's own pattern is its pattern
        out["layer_types"] = list(layer_types)
    return out


def config_overrides(hf: dict) -> dict:
    text = text_config(hf)
    if text.get("model_type") != "qwen3_5_text":
        raise ValueError(f"config.json model_type={text.get('model_type')!r} is not qwen3_5_text")
    return {**hybrid_overrides(text, FAMILY.name), **vision_overrides(hf, text)}


# transformers' Qwen3_5VisionConfig defaults, for a vision_config that leaves a key out (as HF reads it)
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
                   "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "num_position_embeddings": 2304}


def vision_overrides(hf: dict, text: dict) -> dict:
    """A multimodal config.json's vision keys (Qwen3-VL's, without DeepStack), its M-RoPE sections and
    its placeholder and marker token ids; {} for a text model."""
    if hf.get("model_type") not in MULTIMODAL:
        return {}
    from maxlite.families.qwen3_vl import hf as qwen3_vl

    vision = {**VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if vision.get("out_hidden_size") != text["hidden_size"]:
        raise ValueError(f"config.json: vision out_hidden_size={vision.get('out_hidden_size')} is not the "
                         f"decoder's hidden_size={text['hidden_size']}")
    rope = text.get("rope_parameters") or {}
    if not rope.get("mrope_interleaved", True):
        raise ValueError("config.json: mrope_interleaved=false (Qwen2.5-VL's sectioned layout) is not modelled")
    rotated = int((text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
                  * rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    return {**qwen3_vl.vision_overrides({**vision, "model_type": "qwen3_5_vision"}),
            "mrope_sections": turned_sections(rope.get("mrope_section") or (11, 11, 10), rotated // 2),
            "image_token_id": hf["image_token_id"], "video_token_id": hf.get("video_token_id", -1),
            "vision_start_token_id": hf.get("vision_start_token_id", -1),
            "vision_end_token_id": hf.get("vision_end_token_id", -1)}


def turned_sections(sections, half: int) -> tuple[int, int, int]:
    """The M-RoPE sections over the `half` frequencies a head turns, as transformers applies
    `mrope_section` (interleaved: frequency j turns height when j % 3 == 1 and j < 3·sections[1],
    width when j % 3 == 2 and j < 3·sections[2], else time): the frequencies each axis gets, so that
    maxlite's mrope_axes picks the axes transformers picks (the published sections, which sum to
    `half`, come back as they are; transformers' default [11, 11, 10] on a narrower head is cut)."""
    j = np.arange(half)
    h = int(np.sum((j % 3 == 1) & (j < 3 * sections[1])))
    w = int(np.sum((j % 3 == 2) & (j < 3 * sections[2])))
    return half - h - w, h, w


def processor_overrides(hf_dir: str) -> dict:
    """A multimodal checkpoint's image processor (Qwen3-VL's: preprocessor_config.json); {} for a text model."""
    import json
    import pathlib

    from maxlite.families.qwen3_vl import hf as qwen3_vl

    config = json.loads((pathlib.Path(hf_dir) / "config.json").read_text())
    return qwen3_vl.processor_overrides(hf_dir) if config.get("model_type") in MULTIMODAL else {}


def write_processor(cfg, out) -> None:
    """A vision model's preprocessor_config.json, as it was imported (Qwen3-VL's)."""
    if cfg.vision_encoder:
        from maxlite.families.qwen3_vl import hf as qwen3_vl
        qwen3_vl.write_processor(cfg, out)
