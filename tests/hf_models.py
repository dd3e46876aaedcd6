"""The small random Hugging Face models the bridge tests build, one config builder each (moved here from
those test files so that tests/test_model_keys.py imports every one of them, never a test module).
`BUILDERS` names each: the transformers config of a model `hf import` takes, and the maxlite family
it imports as."""

from __future__ import annotations

from typing import Callable

import transformers

# tests/test_bridge_hf.py: Llama 3.1-style RoPE scaling, untied, one kv head; GPT-2
def llama_scaled() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, vocab_size=300, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def gpt2() -> transformers.GPT2Config:
    return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=96, vocab_size=200,
                                   activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


# tests/test_bridge_hf_families.py
FAMILIES_V, FAMILIES_WINDOW = 4096, 6  # the bundled tokenizer's vocabulary; a window the tests' sequences pass
FAMILIES_SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=FAMILIES_V, max_position_embeddings=256, initializer_range=0.3)


def families_config(family: str):
    SMALL, WINDOW = FAMILIES_SMALL, FAMILIES_WINDOW
    if family == "qwen2":  # q/k/v biases, tied
        return transformers.Qwen2Config(**SMALL, num_hidden_layers=2, rope_theta=1e6, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norms, head_dim (32) ≠ hidden/heads (16), untied, YaRN past 16 tokens
        return transformers.Qwen3Config(**SMALL, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                         "original_max_position_embeddings": 16})
    if family == "gemma3":  # 5 local : 1 global (+ 1 local), two RoPEs (global scaled), query scalar
        return transformers.Gemma3TextConfig(
            **SMALL, num_hidden_layers=7, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if family == "gemma3-own-pattern":  # a checkpoint's own layer_types, not the canonical 5 : 1
        return transformers.Gemma3TextConfig(
            **SMALL, num_hidden_layers=5, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                         "full_attention"])
    if family == "olmo3":  # post-norms only, q/k norms over all heads, 3 local : 1 global (+ 1 local);
        # as the published checkpoints: YaRN (no truncation) on the global layers only, one base theta
        return transformers.Olmo3Config(
            **SMALL, num_hidden_layers=5, sliding_window=WINDOW, tie_word_embeddings=False, pad_token_id=0,
            eos_token_id=1, rope_parameters={
                "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4, "truncate": False,
                                   "attention_factor": 1.2, "original_max_position_embeddings": 16},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if family == "gpt_oss":  # sinks, biases everywhere, local/global in turn, YaRN, clamped experts
        return transformers.GptOssConfig(
            **SMALL, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
            num_experts_per_tok=2, swiglu_limit=1.5,
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    return transformers.MistralConfig(**SMALL, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                                      rope_theta=1e6, tie_word_embeddings=False)


FAMILIES = ["qwen2", "qwen3", "gemma3", "gemma3-own-pattern", "mistral", "olmo3", "gpt_oss"]

# tests/test_bridge_hf_moe.py
MOE_V = 256
MOE_SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=MOE_V,
                 max_position_embeddings=64, initializer_range=0.3, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                 tie_word_embeddings=False)


def moe_config(family: str):
    if family == "mixtral":
        return transformers.MixtralConfig(**MOE_SMALL, intermediate_size=16, num_hidden_layers=2, num_local_experts=6)
    return transformers.Qwen3MoeConfig(**MOE_SMALL, intermediate_size=48, moe_intermediate_size=16,
                                       num_hidden_layers=3, num_experts=8, norm_topk_prob=True, mlp_only_layers=[0])


# tests/test_deepseek.py
DEEPSEEK_V = 256
DEEPSEEK_SMALL = dict(hidden_size=32, num_attention_heads=4, vocab_size=DEEPSEEK_V, intermediate_size=48,
                      moe_intermediate_size=16, num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                      first_k_dense_replace=1, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=6,
                      max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False)


def _yarn(mscale, mscale_all_dim):
    """YaRN stretching a 16-token context 4 times (DeepSeek's 4,096 × 40), its softmax factor."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


def deepseek_config(version: str):
    if version == "deepseek_v3":  # groups of 4 experts, each token in the best 1 of 2; weights × 2.5
        return transformers.DeepseekV3Config(**DEEPSEEK_SMALL, num_key_value_heads=4, q_lora_rank=16,
                                             n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                                             rope_parameters=_yarn(1.0, 0.8))
    # DeepSeek-V2-Lite's mscale; groups by their best softmax score
    return transformers.DeepseekV2Config(**DEEPSEEK_SMALL, q_lora_rank=None, n_shared_experts=2,
                                         routed_scaling_factor=1.5, topk_method="group_limited_greedy", n_group=4,
                                         topk_group=2, rope_parameters=_yarn(0.707, 0.707))


# tests/test_bridge_glm4_moe.py
GLM_V = 4096  # the bundled tokenizer's vocabulary


def glm4_moe_config():
    return transformers.Glm4MoeConfig(
        vocab_size=GLM_V, hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
        max_position_embeddings=256, initializer_range=0.3, attention_bias=True, use_qk_norm=True,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})


# tests/test_gpt_oss.py
GPT_OSS_WINDOW = 8


def gpt_oss_config(**kw):
    """4 experts (top 2) of width 32, a clamp low enough to bite, a window of 8 (layer 0 local),
    gpt-oss's YaRN (not truncated) over a shorter original context."""
    return transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=GPT_OSS_WINDOW,
        max_position_embeddings=256, initializer_range=0.3, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0}, **kw)


# tests/test_gemma4.py
GEMMA4_V, GEMMA4_WINDOW = 4096, 6  # the bundled tokenizer's vocabulary; a window the tests' sequences pass
GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma4_text_config(**changes):
    return transformers.Gemma4TextConfig(**{
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
        "attention_k_eq_v": True, "vocab_size": GEMMA4_V, "vocab_size_per_layer_input": GEMMA4_V,
        "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
        "sliding_window": GEMMA4_WINDOW, "final_logit_softcapping": 30.0, "layer_types": GEMMA4_TYPES,
        "initializer_range": 0.3, **changes})


# the MoE variant test_gemma4.py builds too: a dense MLP beside 4 experts (top 2) in every layer
GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                  use_double_wide_mlp=False)

# tests/test_qwen_hybrid.py: key heads of 32 dims (at 16 the float32 rounding of transformers' own
# chunked and recurrent forms already differ by ~1e-5 on random weights of this scale)
QWEN_HYBRID_V = 256
QWEN_HYBRID_SMALL = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_hidden_layers=4, vocab_size=QWEN_HYBRID_V, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=32, linear_value_head_dim=16, initializer_range=0.1, max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
QWEN_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# the MoE models: two layers of their own pattern (what `layer_types` carries), Qwen3-Next's first one
# dense (mlp_only_layers)
QWEN_HYBRID_TWO = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
_S, _M, _T = QWEN_HYBRID_SMALL, QWEN_HYBRID_MOE, QWEN_HYBRID_TWO
QWEN_HYBRID_CONFIGS = {
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**_S),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**{**_S, **_T}, **_M, mlp_only_layers=[0]),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**{**_S, **_T}, **_M),
}

# every model above by name → its config
BUILDERS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama3-scaled": llama_scaled, "gpt2": gpt2,
    **{f: (lambda f=f: families_config(f)) for f in FAMILIES},
    **{f: (lambda f=f: moe_config(f)) for f in ("mixtral", "qwen3_moe")},
    **{v: (lambda v=v: deepseek_config(v)) for v in ("deepseek_v2", "deepseek_v3")},
    "glm4_moe": glm4_moe_config, "gpt_oss-clamped": gpt_oss_config,
    "gemma4": gemma4_text_config, "gemma4-moe": lambda: gemma4_text_config(**GEMMA4_MOE),
    **QWEN_HYBRID_CONFIGS,
}
