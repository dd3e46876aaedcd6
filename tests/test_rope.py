"""RoPE variants against transformers' own rotary code: YaRN (with and without truncation, with
DeepSeek's mscale pair, with a stated attention factor) and partial rotary embeddings, through
GLM-4-MoE's rotary embedding and apply_rotary_pos_emb (split halves on the first fraction of each head)."""

import numpy as np
import pytest
import torch
import transformers
from transformers.models.glm4_moe import modeling_glm4_moe as glm

from maxlite import config as C
from maxlite.config import ConfigError
from maxlite.bridge import hf_llama
from maxlite.models.layers import apply_rope, rope_attention_factor, rope_frequencies

H, T = 32, 48

CASES = {
    "partial": ({"rope_type": "default"}, 0.5),
    "yarn": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}, 1.0),
    "yarn-no-truncate": ({"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 8,
                          "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0}, 1.0),
    "yarn-mscale-partial": ({"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16,
                             "mscale": 1.0, "mscale_all_dim": 0.707}, 0.25),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                               "attention_factor": 1.3}, 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rotation_equals_transformers(case):
    rope, partial = CASES[case]
    hf_cfg = transformers.Glm4MoeConfig(hidden_size=64, num_attention_heads=2, head_dim=H, max_position_embeddings=512,
                                        rope_parameters={**rope, "rope_theta": 1e4, "partial_rotary_factor": partial})
    positions = torch.arange(T)[None].repeat(2, 1) * 3  # past the original context
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, T, 4, H)).astype(np.float32)
    k = rng.standard_normal((2, T, 1, H)).astype(np.float32)
    emb = glm.Glm4MoeRotaryEmbedding(hf_cfg)
    cos, sin = emb(torch.from_numpy(q), positions)
    q_hf, k_hf = glm.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin, unsqueeze_dim=2)

    keys = hf_llama.rope_keys(hf_cfg.rope_parameters, 1e4, hf_cfg.to_dict())
    cfg = C.load(["base.yml", "model_name=tiny", f"head_dim={H}", *(f"{k}={v}" for k, v in keys.items())])
    inv_freq = np.asarray(rope_frequencies(cfg), np.float32)
    assert inv_freq.shape == (int(H * partial) // 2,)
    np.testing.assert_allclose(inv_freq, emb.inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(emb.attention_scaling, rel=1e-7)
    scale = rope_attention_factor(cfg)
    for ours, theirs in ((apply_rope(q, positions.numpy(), inv_freq, scale), q_hf),
                         (apply_rope(k, positions.numpy(), inv_freq, scale), k_hf)):
        np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=2e-5, rtol=1e-5)
    # and back: the config.json rope parameters we write are the ones we read
    back = hf_llama.rope_dict(cfg)
    assert hf_llama.rope_keys(back, 0) == keys


def test_a_rotary_fraction_that_leaves_no_even_dimensions_is_refused():
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.01 rotates 0 of head_dim=32"):
        C.load(["base.yml", "model_name=tiny", "head_dim=32", "partial_rotary_factor=0.01"])
