"""Small random Hugging Face models built by transformers, one per model type the bridge imports: what
the bridge tests import and export, and what tests/hf_parity.py compares with XLA's default code
generation. `config(name)` is the model's config; `model(name)` the random model in eval mode, its
norms, biases (and where a family has them, routing biases and layer scalars) moved away from HF's
starting 0 or 1, where a swapped or dropped one would not show. Tokenizers and chat templates stay
with the tests that check them. Imports torch and transformers (test files that use it need both)."""

from __future__ import annotations

import torch
import transformers

WINDOW = 6  # the sliding window of the attention families: their tests' sequences run well past it
# Gemma 4: 2 local : 1 global, twice; the Qwen hybrids' MoE models: two layers of their own pattern
GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
HYBRID_TWO = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])

_ATTN = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
             max_position_embeddings=256, initializer_range=0.3)
_MOE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=256,
            max_position_embeddings=64, initializer_range=0.3, num_experts_per_tok=2, router_aux_loss_coef=0.02,
            tie_word_embeddings=False)
_DEEPSEEK = dict(hidden_size=32, num_attention_heads=4, vocab_size=256, intermediate_size=48, moe_intermediate_size=16,
                 num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
                 kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=64,
                 initializer_range=0.3, tie_word_embeddings=False)
# key heads of 32 dims: at 16 the float32 rounding of transformers' own chunked and recurrent forms
# already differ by ~1e-5 on random weights of this scale
_HYBRID = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=4, vocab_size=256, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=32, linear_value_head_dim=16, initializer_range=0.1, max_position_embeddings=512,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _yarn(mscale, mscale_all_dim):
    """YaRN stretching a 16-token context 4 times (DeepSeek's 4,096 × 40), its softmax factor."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


def qwen3_vl(layers: int = 2, positions: int = 256, depth: int = 1, init: float = 0.3, **vision):
    """A small Qwen3-VL config: `layers` decoder layers of 64, a ViT of `depth` blocks of 32 with
    8-pixel patches and DeepStack from each block; image / video / start / end ids 250 / 251 / 252 / 253.
    `vision`: more of the ViT's keys."""
    return transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=positions,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2],
                                          "mrope_interleaved": True}, tie_word_embeddings=False,
                         initializer_range=init),
        vision_config=dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                           out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=list(range(depth)), **vision),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def qwen3_vl_moe(experts: int = 8, width: int = 24, **dense):
    """A small Qwen3-VL-MoE config: qwen3_vl(**dense)'s decoder and tower, with `experts` experts of
    `width` (top 2) in every decoder layer. 2·width ≠ 64 (the decoder's width): the two layouts of its
    fused expert tensors (tests/test_qwen3_vl_moe.py) read apart."""
    config = qwen3_vl(**dense).to_dict()
    text, vision = ({k: v for k, v in config[part].items() if k != "model_type"} for part in ("text_config", "vision_config"))
    text.update(num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=width, decoder_sparse_step=1,
                mlp_only_layers=[], router_aux_loss_coef=0.001)
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=250, video_token_id=251,
                                         vision_start_token_id=252, vision_end_token_id=253)


GEMMA_CHAT_TOKENS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>", "<end_of_image>"]


def gemma3_chat_tokenizer():
    """The bundled tokenizer with Gemma's turn and image tokens (<end_of_turn> its end) and a Gemma-style
    chat template that writes one <start_of_image> per image, as Gemma3Processor expects."""
    from maxlite.data.tokenizer import BUNDLED_DIR

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"), eos_token="<end_of_turn>",
        extra_special_tokens={"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                              "eoi_token": "<end_of_image>"})
    tok.add_special_tokens({"additional_special_tokens": GEMMA_CHAT_TOKENS})
    tok.chat_template = (
        "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    return tok


def save_gemma3_chat_model(path, width: int, layer_types: list[str], sliding_window: int, tower_width: int,
                           tokens: int = 16) -> None:
    """A random Gemma3ForConditionalGeneration saved under `path` as `hf import` reads one: decoder
    layers of `width` (4 heads over 2 kv heads, MLP 2× wide) of `layer_types`, a 2-layer SigLIP tower of
    `tower_width` on 64-pixel squares in 8-pixel patches pooled to `tokens` soft tokens, its
    gemma3_chat_tokenizer and its Gemma3ImageProcessorPil (mean and std 0.5)."""
    tok = gemma3_chat_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_CHAT_TOKENS}
    text = dict(vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width,
                num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=width // 4,
                layer_types=layer_types, sliding_window=sliding_window, max_position_embeddings=512,
                query_pre_attn_scalar=width // 4)
    vision = dict(hidden_size=tower_width, intermediate_size=2 * tower_width, num_hidden_layers=2,
                  num_attention_heads=2, image_size=64, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens,
                                       boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                                       image_token_index=ids["<image_soft_token>"])
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(config).eval().save_pretrained(str(path))
    tok.save_pretrained(str(path))
    transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}, image_mean=[0.5] * 3,
                                         image_std=[0.5] * 3).save_pretrained(str(path))


def gemma3_vl(tokens: int = 16, boi: int = 250, eoi: int = 251, image: int = 252):
    """A small Gemma3ForConditionalGeneration config: a 2-layer decoder of 64 (one sliding, one full
    layer), a 2-layer SigLIP tower of 32 over 64-pixel squares in 8-pixel patches, `tokens` soft
    tokens an image."""
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"],
                sliding_window=6, max_position_embeddings=512, query_pre_attn_scalar=16,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=8)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=tokens,
                                     boi_token_index=boi, eoi_token_index=eoi, image_token_index=image)


def gemma4_vl(image: int = 4000, boi: int = 4001, eoi: int = 4002, bidirectional: bool = True):
    """A small Gemma4ForConditionalGeneration config: gemma4_text's decoder (every trait; sliding
    window 6, shorter than an image) with a 2-layer tower of 32 (two heads over one kv head of 16)
    on 4-pixel patches pooled 2×2, its soft tokens standardised; `bidirectional`: the sliding-window
    layers see each image both ways (use_bidirectional_attention: vision)."""
    text = gemma4_text(use_bidirectional_attention="vision" if bidirectional else None).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64,
                  standardize=True)
    return transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None, image_token_id=image,
                                     boi_token_id=boi, eoi_token_id=eoi)


def qwen3_5_vl(layer_types=("linear_attention", "full_attention"), depth: int = 2, moe: bool = False, **top):
    """A small multimodal Qwen3.5 config (Qwen3_5ForConditionalGeneration, or Qwen3.5-MoE's with `moe`):
    the hybrid decoder of 64 (`layer_types`), 12 of each head's 16 dims rotated by M-RoPE, sections
    [2, 2, 2] (time, height and width each turn 2 frequencies), a ViT of `depth` blocks of 32 with 8-pixel patches (no DeepStack); image / video /
    start / end ids 250 / 251 / 252 / 253 unless `top` says otherwise."""
    text = {**_HYBRID, "num_hidden_layers": len(layer_types), "layer_types": list(layer_types),
            "rope_parameters": {**_HYBRID["rope_parameters"], "partial_rotary_factor": 0.75, "mrope_section": [2, 2, 2],
                                "mrope_interleaved": True},
            "tie_word_embeddings": False, **(_HYBRID_MOE if moe else {})}
    vision = dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16, in_channels=3)
    config = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    return config(text_config=text, vision_config=vision, **{
        "image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253, **top})


def gemma4_text(**changes):
    """Every trait of Gemma 4 at once: per-layer embeddings, the last layers sharing keys and values
    (with double-wide MLPs), wide global layers with fewer kv heads whose keys are the values."""
    return transformers.Gemma4TextConfig(**{
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "vocab_size": 4096, "vocab_size_per_layer_input": 4096,
        "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
        "sliding_window": WINDOW, "final_logit_softcapping": 30.0, "layer_types": GEMMA4_TYPES,
        "initializer_range": 0.3, **changes})


CONFIGS = {
    # GQA with one kv head, head_dim ≠ hidden/heads, Llama 3's RoPE scaling
    "llama": lambda: transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
        tie_word_embeddings=False, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "gpt2": lambda: transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=96, vocab_size=200,
                                            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                            attn_pdrop=0.0),
    "mistral": lambda: transformers.MistralConfig(**_ATTN, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                                                  rope_theta=1e6, tie_word_embeddings=False),
    # q/k/v biases, tied
    "qwen2": lambda: transformers.Qwen2Config(**_ATTN, num_hidden_layers=2, rope_theta=1e6, tie_word_embeddings=True),
    # q/k norms, head_dim (32) ≠ hidden/heads (16), untied, YaRN past 16 tokens
    "qwen3": lambda: transformers.Qwen3Config(**_ATTN, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False,
                                              rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                               "original_max_position_embeddings": 16}),
    # 5 local : 1 global (+ 1 local), two RoPEs (global scaled), query scalar
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **_ATTN, num_hidden_layers=7, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # a checkpoint's own layer_types, not the canonical 5 : 1
    "gemma3-own-pattern": lambda: transformers.Gemma3TextConfig(
        **_ATTN, num_hidden_layers=5, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention", "full_attention"]),
    # post-norms only, q/k norms over all heads, 3 local : 1 global (+ 1 local); as the published
    # checkpoints: YaRN (no truncation) on the global layers only, one base theta
    "olmo3": lambda: transformers.Olmo3Config(
        **_ATTN, num_hidden_layers=5, sliding_window=WINDOW, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, rope_parameters={
            "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4, "truncate": False,
                               "attention_factor": 1.2, "original_max_position_embeddings": 16},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # sinks, biases everywhere, local/global in turn, YaRN, clamped experts
    "gpt_oss": lambda: transformers.GptOssConfig(
        **_ATTN, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
        num_experts_per_tok=2, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0}),
    "mixtral": lambda: transformers.MixtralConfig(**_MOE, intermediate_size=16, num_hidden_layers=2,
                                                  num_local_experts=6),
    # a dense first layer (mlp_only_layers=[0]), stored apart from the scanned MoE layers
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**_MOE, intermediate_size=48, moe_intermediate_size=16,
                                                     num_hidden_layers=3, num_experts=8, norm_topk_prob=True,
                                                     mlp_only_layers=[0]),
    # DeepSeek-V2-Lite's mscale; groups by their best softmax score; no query latent
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **_DEEPSEEK, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, rope_parameters=_yarn(0.707, 0.707)),
    # groups of 4 experts, each token in the best 1 of 2; weights × 2.5; a query latent
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **_DEEPSEEK, num_key_value_heads=4, q_lora_rank=16, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, rope_parameters=_yarn(1.0, 0.8)),
    # DeepSeek-V3's model with sparse attention: each query keeps the indexer's best 6 earlier tokens
    # (16 heads of 16, the first 8 dims rotated), so the tests' sequences run well past it. With 4 heads
    # several tokens of a row score exactly 0 (every head's ReLU zero) and transformers' top-k breaks
    # such ties in another order than XLA's (logits 12% apart); with 16 a tie is rare
    "deepseek_v32": lambda: transformers.DeepseekV32Config(
        **_DEEPSEEK, num_key_value_heads=4, q_lora_rank=16, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, rope_parameters=_yarn(1.0, 0.8), index_topk=6, index_n_heads=16,
        index_head_dim=16),
    # GLM-5: DeepSeek-V3.2's model with the indexer's RoPE on interleaved pairs; no expert groups, no
    # YaRN (GLM's own); the indexer as deepseek_v32's (16 heads, best 6)
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(
        **_DEEPSEEK, num_key_value_heads=4, q_lora_rank=16, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, index_topk=6, index_n_heads=16, index_head_dim=16),
    "gemma4": gemma4_text,
    # a dense MLP beside 4 experts (top 2) in every layer
    "gemma4_moe": lambda: gemma4_text(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                       moe_intermediate_size=32, use_double_wide_mlp=False),
    # half-rotary RoPE, q/k norms, q/k/v biases, a dense first layer, grouped sigmoid routing, a shared
    # expert, scaled weights
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
        max_position_embeddings=256, initializer_range=0.3, attention_bias=True, use_qk_norm=True,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    # DeepSeek's MLA and MoE (one dense layer, then MoE): softmax routing, renormalised, weights × 1.5;
    # YaRN with the published mscale = mscale_all_dim, no Llama 4 query scale (β = 0: maxlite has none)
    "mistral4": lambda: transformers.Mistral4Config(
        **{**_DEEPSEEK, "num_hidden_layers": 2, "vocab_size": 4096}, num_key_value_heads=4, q_lora_rank=16,
        n_shared_experts=1, routed_scaling_factor=1.5,
        rope_parameters={**_yarn(1.0, 1.0), "llama_4_scaling_beta": 0.0}),
    # q/k norms over every head at once, half-rotary RoPE, 6 experts in every layer routed by sigmoid
    # with a nonzero choice bias (the bundled tokenizer's vocabulary: the bridge family tests export it)
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        vocab_size=4096, hidden_size=64, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256,
        initializer_range=0.3, tie_word_embeddings=False, bos_token_id=None, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    # Llama 4: chunks of 8 (the tests' prompts and 32 new tokens span several), 3 chunked RoPE layers : 1
    # global NoPE layer whose queries are tempered from position 3 on (floor 4, not 8192), dense and MoE
    # layers in turn (the NoPE layer MoE), the scaleless q/k norm, llama3 RoPE scaling as Scout's
    "llama4_text": lambda: transformers.Llama4TextConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4, attn_scale=0.5, use_qk_norm=True,
        max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=1, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 32}),
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**_HYBRID),
    # Kimi delta attention (per-channel decay, low-rank gates) around a NoPE latent-attention layer
    # (query latent), a dense first layer then DeepSeekMoE: groups of 2 experts, the best 1 of 2, weights × 2.5
    "kimi_linear": lambda: transformers.KimiLinearConfig(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=6, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, linear_num_heads=2, linear_head_dim=32, linear_conv_kernel_dim=4,
        initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    # DeepSeek-V4: one layer of each attention (a sliding window of 8; compressed every 8 tokens; compressed
    # every 4 with the indexer of 16 heads keeping 3: fewer heads leave exact ties at 0 in its scores, which
    # torch and JAX break apart) and a second heavily compressed one, 4 query heads of 32 over one
    # shared key=value head (RoPE on the last 8), sinks, 2 output groups; 3 residual streams; 8 experts (top
    # 2), the first layer hash-routed, clamped at 3; YaRN on the compressed layers' RoPE; 3 Sinkhorn passes,
    # not the published 20: XLA's compile of the unrolled passes grows faster than their number (the
    # shrunk preset's training step 22.9 CPU-s with 20, 7.4 with 3: benchmarks/results/sinkhorn_compile.json),
    # and 3 run every operation
    "deepseek_v4": lambda: transformers.DeepseekV4Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        partial_rotary_factor=0.25, sliding_window=8, index_n_heads=16, index_head_dim=16, index_topk=3, o_groups=2,
        o_lora_rank=16, hc_mult=3, hc_sinkhorn_iters=3, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, swiglu_limit=3.0, routed_scaling_factor=1.5,
        max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0}),
    # Nemotron-H: a Mamba-2 block, an attention block (no positions), an MLP block, a Mamba-2 block;
    # chunks of 8 so that the tests' sequences cross chunks; heads in 2 groups of B and C (the bundled
    # tokenizer's vocabulary: the bridge family tests export it)
    "nemotron_h": lambda: transformers.NemotronHConfig(
        vocab_size=4096, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
        max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False, eos_token_id=1,
        bos_token_id=None, pad_token_id=0),
    # Qwen3-Next's first layer dense (mlp_only_layers)
    # Qwen3-VL's decoder on text (multimodal RoPE with every axis equal; images: tests/test_qwen3_vl.py)
    "qwen3_vl": lambda: qwen3_vl(),
    "qwen3_vl_moe": lambda: qwen3_vl_moe(),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**{**_HYBRID, **HYBRID_TWO}, **_HYBRID_MOE, mlp_only_layers=[0]),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**{**_HYBRID, **HYBRID_TWO}, **_HYBRID_MOE),
}


def config(name: str):
    """The transformers config of a CONFIGS model."""
    return CONFIGS[name]()


def _perturbed(model, seed: int = 0, scale: float = 0.2):
    """Every 1-D parameter and every bias (gpt-oss's experts' biases are [E, ...]) + scale · N(0, 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_bias"):
                p.add_(scale * torch.randn_like(p))
    return model


def gemma4_perturbed(model, seed: int = 0):
    """Norm scales and layer scalars away from 1; the √d-scaled tied embeddings shrunk (a random Gemma
    repeats itself otherwise)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.add_(0.2 * torch.randn_like(b))
        model.get_input_embeddings().weight.mul_(0.05)
    return model


def _deepseek_perturbed(model, seed: int = 0):
    """Norms and the expert-choice bias (a buffer, starting at 0) moved."""
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.ndim == 1 and "inv_freq" not in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _deepseek_v4_perturbed(model, seed: int = 0):
    """As DeepSeek's, and the compressors' position biases (zero at init) moved, and each token's
    hash-routed experts drawn (transformers starts the table at 0: every token to expert 0)."""
    _deepseek_perturbed(model, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("position_bias"):
                p.add_(0.5 * torch.randn(p.shape, generator=generator))
        E, k = model.config.n_routed_experts, model.config.num_experts_per_tok
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(E, generator=generator)[:k] for _ in range(b.shape[0])]))
    return model


def _gemma3_perturbed(model, seed: int = 0):
    """As _perturbed, and the √d-scaled tied embeddings shrunk (a random Gemma repeats itself otherwise)."""
    _perturbed(model)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.05)
    return model


def _glm_perturbed(model, seed: int = 0):
    """As _perturbed, and a nonzero expert-choice bias in every MoE layer."""
    _perturbed(model)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(model.config.n_routed_experts))
    return model


def _minimax_perturbed(model, seed: int = 0):
    """As _perturbed, and a nonzero expert-choice bias (a buffer, starting at 0) in every layer: it changes
    the choices (the logits move by 0.47 relative without it)."""
    _perturbed(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.copy_(0.1 * torch.randn(model.config.num_local_experts))
    return model


PERTURB = {"llama": lambda m, seed: _perturbed(m, seed, 0.3),
           "gemma3": _gemma3_perturbed, "gemma3-own-pattern": _gemma3_perturbed, "deepseek_v2": _deepseek_perturbed,
           "deepseek_v3": _deepseek_perturbed, "deepseek_v32": _deepseek_perturbed, "glm_moe_dsa": _deepseek_perturbed, "kimi_linear": _deepseek_perturbed,
           "deepseek_v4": _deepseek_v4_perturbed, "gemma4": gemma4_perturbed, "gemma4_moe": gemma4_perturbed,
           "glm4_moe": _glm_perturbed, "minimax_m2": _minimax_perturbed}
# Gemma 4's MoE at seed 0 puts a router near-tie (2nd and 3rd expert 9e-8 apart) on a greedy path,
# where float32 rounding picks either: seed 1 has none
SEEDS = {"gemma4_moe": 1}
# transformers 5.25 registers Mistral4ForCausalLM with AutoModelForPreTraining, not AutoModelForCausalLM;
# keyed by model type (the CONFIGS names of these models are their model types)
AUTO = {"mistral4": transformers.AutoModelForPreTraining, "qwen3_vl": transformers.AutoModelForImageTextToText,
        "qwen3_vl_moe": transformers.AutoModelForImageTextToText}


def auto_class(name: str):
    """The transformers auto class that builds and loads a model of type `name` (or the CONFIGS model
    `name`) from its config."""
    return AUTO.get(name, transformers.AutoModelForCausalLM)


def model(name: str):
    """The random CONFIGS model `name` (float32, eval mode), perturbed."""
    seed = SEEDS.get(name, 0)
    torch.manual_seed(seed)
    built = auto_class(name).from_config(config(name)).eval()
    return PERTURB.get(name, _perturbed)(built, seed)
