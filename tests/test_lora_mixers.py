"""LoRA on latent attention's projections (DeepSeek's q_a/q_b/q, kv_a_proj_with_mqa, kv_b, o_proj), on
the gated delta-net's (Qwen3.5's in_proj_qkv/z/b/a, Qwen3-Next's fused in_proj_qkvz/ba, out_proj) and on
DeepSeek-V4's attention (q_a/q_b_proj, kv_proj, o_b_proj), on
tiny random models built by transformers: only the adapters train, they change the logits, training's
dropout reaches them, merging them into the weights changes nothing, the PEFT adapter directory
computes in real `peft` on the transformers model what maxlite computes, and decoding through the
latent cache / the recurrent state with the adapters computes the same logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from maxlite import config as C
from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.bridge.peft import export_peft
from maxlite.models import lora
from maxlite.state import abstract_params, split_trainable
from tests import hf_models

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 256
SMALL_MLA = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, vocab_size=V, intermediate_size=48,
                 moe_intermediate_size=16, num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2,
                 first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=12, qk_rope_head_dim=8,
                 qk_nope_head_dim=8, v_head_dim=6, max_position_embeddings=64, initializer_range=0.3,
                 tie_word_embeddings=False)
SMALL_GDN = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=V,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 initializer_range=0.1, max_position_embeddings=64,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
CASES = {  # HF config, lora_targets, whether to decode (Qwen3-Next's delta-net decodes as Qwen3.5's)
    # a query latent; the MoE layer's attention adapted like the dense one's
    "deepseek_v3": (lambda: transformers.DeepseekV3Config(**SMALL_MLA, q_lora_rank=16, n_group=2, topk_group=1),
                    "[q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj]", True),
    # the delta-net's separate projections beside the gated attention's q_proj (its gate rows not adapted)
    "qwen3_5_text": (lambda: transformers.Qwen3_5TextConfig(**SMALL_GDN),
                     "[in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, q_proj, down_proj]", True),
    # the fused ones, grouped by key head in the HF tensor (the first layer's MLP dense, as it imports)
    "qwen3_next": (lambda: transformers.Qwen3NextConfig(**SMALL_GDN, mlp_only_layers=[0], num_experts=4,
                                                        num_experts_per_tok=2, moe_intermediate_size=16,
                                                        shared_expert_intermediate_size=16),
                   "[in_proj_qkvz, in_proj_ba, out_proj]", False),
    # DeepSeek-V4: the query latent's projections, the one key=value head, the grouped output's second
    # projection (PEFT names them by transformers' modules, self_attn.q_a_proj, … : not the compressors'
    # kv_proj or the indexer's q_b_proj), in a sliding, a compressed sparse and two heavily compressed layers
    "deepseek_v4": (lambda: hf_models.config("deepseek_v4"), "[q_a_proj, q_b_proj, kv_proj, o_b_proj]", True),
}


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _model(cfg, pure):
    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


@nnx.jit
def _logits(model, ids, key):
    """float32 logits without dropout, and with the adapters' dropout drawn from `key` as training
    draws it (a model with lora_dropout > 0): one compilation."""
    positions, segments = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape), jnp.ones(ids.shape, jnp.int32)
    return model(ids, positions, segments), model(ids, positions, segments, key)


@nnx.jit
def _decoded_logits(model, ids):
    """Logits of ids [1, 7] through the decode path: a prefill of 6 tokens, then a step of one token
    (latent attention against its cached latent, the delta-net from its state)."""
    from maxlite.models import decode

    P, T = 6, ids.shape[1]
    positions, lengths = jnp.arange(T)[None], jnp.arange(1, T + 1)
    cache = decode.empty_cache(model.cfg, 1, T)
    x, cache = decode.forward(model, ids[:, :P], positions[:, :P], lengths[P - 1:P], cache,
                              decode.prefill_config(model.cfg, P))
    out = [model.logits(x)]
    for t in range(P, T):
        x, cache = decode.forward(model, ids[:, t:t + 1], positions[:, t:t + 1], lengths[t:t + 1], cache)
        out.append(model.logits(x))
    return jnp.concatenate(out, axis=1)


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_on_the_mixers_merges_exports_to_peft_and_decodes(case, tmp_path):
    peft = pytest.importorskip("peft")  # in the test extra; the skip is for installs without it
    make, targets, decode = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make()).eval()
    model.save_pretrained(str(tmp_path / "hf"))
    keys = ["max_target_length=32", "dtype=float32"]
    cfg, pure = hf.import_hf(str(tmp_path / "hf"), keys)
    lcfg, _ = hf.import_hf(str(tmp_path / "hf"), [*keys, "lora_rank=2", "lora_alpha=4", "lora_dropout=0.5",
                                                  f"lora_targets={targets}"])
    # the imported base, random adapters (B not zero, so that every adapter shows in the logits)
    lpure = P.random_params(lcfg, seed=1, std=0.05)
    for leaf, value in P.leaves(pure):
        P.put(lpure, leaf, value)
    state = P.to_state(lcfg, P.to_jax_inplace(P.to_pure(lpure)))

    # only the adapters train (the optimizer holds split_trainable's first part); each target has its A
    adapters, base = split_trainable(state)
    trained = [p for p, _ in P.leaves(nnx.to_pure_dict(adapters))]
    assert trained and all("_lora_" in str(p[-1]) for p in trained)
    assert not any("_lora_" in str(p[-1]) for p, _ in P.leaves(nnx.to_pure_dict(base)))
    assert {lora.ADAPTERS[t][0] + "_lora_a" for t in lcfg.lora_targets} <= {str(p[-1]) for p in trained}

    ids = np.random.default_rng(4).integers(0, V, (1, 24))
    ours, dropped = map(np.asarray, _logits(_model(lcfg, lpure), ids, jax.random.key(0)))
    assert _relative(ours, _torch_logits(model, ids)) > 1e-2  # the adapters count (the base imports exactly)
    assert _relative(dropped, ours) > 1e-3  # training's dropout reaches them
    # `hf export` merges them into the weights: transformers computes what the adapters compute
    hf.export_hf(lcfg, state, str(tmp_path / "merged"), tokenizer="none")
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert _relative(_torch_logits(merged, ids), ours) <= 1e-5

    # the PEFT adapter directory on the transformers model computes it too
    export_peft(lcfg, state, str(tmp_path / "adapter"))
    with_adapter = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    assert _relative(_torch_logits(with_adapter, ids), ours) <= 1e-5
    # the modules PEFT adapts (adapter_config's target_modules) are those the file has weights for
    from safetensors import safe_open
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "np") as f:
        exported = {k.removesuffix(".lora_A.weight") for k in f.keys() if k.endswith(".lora_A.weight")}
    assert {n.removesuffix(".lora_A") for n, _ in with_adapter.named_modules() if n.endswith(".lora_A")} == exported
    # decoding with the adapters unmerged (kv_b_proj's folded into the weight latent attention's decode
    # absorbs; in the delta-net's recurrent steps) computes the same logits
    if decode:
        assert _relative(np.asarray(_decoded_logits(_model(lcfg, lpure), ids[:, :7])), ours[:, :7]) <= 1e-5


def test_targets_a_model_does_not_have_are_one_line():
    mla = ["base.yml", "model_name=tiny-deepseek", "lora_rank=4"]
    with pytest.raises(C.ConfigError, match="k_proj, v_proj is not a projection of this model"):
        C.load([*mla, "lora_targets=[q_a_proj, k_proj, v_proj]"])
    with pytest.raises(C.ConfigError, match="q_proj is not a projection"):  # a query latent: q_a_proj, q_b_proj
        C.load([*mla, "lora_targets=[q_proj]"])
    assert C.load([*mla, "q_lora_rank=0", "lora_targets=[q_proj, kv_b_proj]"]).lora_rank == 4
    with pytest.raises(C.ConfigError, match="in_proj_qkvz is in_proj_qkv \\+ in_proj_z fused"):
        C.load(["base.yml", "model_name=tiny-hybrid", "lora_rank=4", "lora_targets=[in_proj_qkvz, in_proj_z]"])
    with pytest.raises(C.ConfigError, match="in_proj_qkv is not a projection"):
        C.load(["base.yml", "model_name=tiny", "lora_rank=4", "lora_targets=[in_proj_qkv]"])
