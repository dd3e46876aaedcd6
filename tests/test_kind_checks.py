"""Each kind's recipe checks (maxlite/models/kind_checks.py), run by config validation for the kinds
a recipe's layers use: every message in full, as the user reads it."""

import dataclasses
import re

import pytest

from maxlite import config as C
from maxlite.models import kinds

GROUPS = "the groups must divide num_experts=8 and 1 <= topk_routing_group <= n_routing_groups (-1, -1: no groups)"
MOE = "model_name=tiny-moe"


@pytest.mark.parametrize("argv, message", [
    (["model_name=tiny", "num_experts=4"], "num_experts=4, mlp_bias=False, router_logit_bias=False: "
     "decoder_block=llama2 has a dense MLP; mixtures of experts are the families "),
    ([MOE, "num_experts=0"], "decoder_block=mixtral needs num_experts and base_moe_mlp_dim > 0, got 0 and 384"),
    ([MOE, "shared_experts=-1"], "shared_experts=-1 must be >= 0"),
    ([MOE, "first_num_dense_layers=4"],
     "first_num_dense_layers=4 must leave at least one of the 4 layers for the experts"),
    ([MOE, "interleave_moe_layer_step=0"],
     "interleave_moe_layer_step=0 must divide the 4 layers after first_num_dense_layers"),
    ([MOE, "ragged_buffer_factor=0"], "ragged_buffer_factor=0.0: -1 (every sender's rows) or > 0"),
    ([MOE, "capacity_factor=0"], "capacity_factor=0.0: -1 (dropless) or > 0"),
    ([MOE, "router_z_loss_weight=-1"],
     "load_balance_loss_weight and router_z_loss_weight must be >= 0"),
    ([MOE, "routed_bias_update_rate=0.001"],
     "routed_bias_update_rate=0.001 moves the routing bias: set routed_bias=true"),
    ([MOE, "n_routing_groups=3", "topk_routing_group=1"],
     f"n_routing_groups=3, topk_routing_group=1: {GROUPS}"),
    ([MOE, "routed_score_func=sigmoid", "n_routing_groups=8", "topk_routing_group=2"],
     "n_routing_groups=8: a group's score is the sum of its best 2 experts, so each group needs 2 of the "
     "num_experts=8"),
    ([MOE, "n_routing_groups=4", "topk_routing_group=1", "num_experts_per_tok=3"],
     "topk_routing_group=1 groups of 2 experts hold fewer than num_experts_per_tok=3"),
    (["model_name=tiny-deepseek", "qk_rope_head_dim=3"],
     "qk_rope_head_dim=3: RoPE rotates pairs of dims, make it even"),
    (["model_name=gemma4-tiny", "partial_rotary_factor=0.5"],
     "decoder_block=gemma4 has its own RoPE (default on sliding-window layers, proportional by "
     "global_rope_fraction on global ones): leave partial_rotary_factor and rope_scaling_factor unset"),
    (["model_name=tiny", "attention_k_eq_v=true"],
     "attention_k_eq_v shapes Gemma 4's layers (decoder_block=gemma4), not llama2's"),
    (["model_name=gemma4-tiny", "num_kv_shared_layers=6"],
     "num_kv_shared_layers=6: at least one layer must compute keys and values"),
    (["model_name=gemma4-tiny", "decoder_block=gemma4_moe", "num_experts=4", "base_moe_mlp_dim=32"],
     "use_double_wide_mlp widens dense MLPs, not a mixture of experts' (gemma4_moe)"),
    (["model_name=deepseek-v3.2", "q_lora_rank=0"],
     "DeepSeek sparse attention's indexer reads the query latent: set q_lora_rank > 0"),
    (["model_name=deepseek-v3.2", "index_head_dim=32"],
     "index_head_dim=32 must be at least qk_rope_head_dim=64 (the indexer rotates that many of its dims)"),
    (["model_name=deepseek-v3", "index_stage=dense_warmup"],
     "index_stage=dense_warmup trains DeepSeek sparse attention's indexer: decoder_block=deepseek has none "
     "(deepseek_v32 and glm_moe_dsa have)"),
    (["model_name=deepseek-v3.2", "index_stage=dense_warmup", "lora_rank=4", "lora_targets=[o_proj]"],
     "index_stage=dense_warmup trains the indexer alone, lora_rank=4 trains adapters alone: set lora_rank=0 "
     "for the warm-up"),
])
def test_each_kinds_mistakes_are_refused_in_its_words(argv, message):
    with pytest.raises(C.ConfigError, match=re.escape(message)):
        C.load(["base.yml", *argv])


@pytest.mark.parametrize("argv, devices, message", [
    ([MOE, "base_moe_mlp_dim=383", "ici_tensor_parallelism=2"], 2,
     "base_moe_mlp_dim=383 is not divisible by tensor parallelism 2"),
    (["model_name=tiny-hybrid", "ici_context_parallelism=2"], 2,
     "context parallelism (context=2) does not split gated delta-net layers (qwen3_5): "
     "set ici_context_parallelism=1 (and dcn_context_parallelism=1)"),
    (["model_name=deepseek-v3.2", "ici_context_parallelism=2"], 2,
     "context parallelism (context=2) does not split DeepSeek sparse attention's indexer (deepseek_v32): "
     "set ici_context_parallelism=1 (and dcn_context_parallelism=1)"),
])
def test_each_kinds_mesh_mistakes_are_refused_in_its_words(argv, devices, message):
    with pytest.raises(C.ConfigError, match=re.escape(message)):
        C.resolve(C.load(["base.yml", *argv]), devices)


def test_validation_runs_the_checks_a_kind_names(monkeypatch):
    """Naming a check in a kind's entry is all it takes: the recipes whose layers have the kind run it
    (told so), the others run it told they have none; config_checks names no kind."""
    calls = []

    def check(cfg, used):
        calls.append((cfg.decoder_block, used))
        return "made-up problem" if used and cfg.qk_rope_head_dim % 2 else None

    monkeypatch.setattr(kinds, "load", lambda path, load=kinds.load: check if path == "made:up" else load(path))
    monkeypatch.setitem(kinds.MIXERS, "attention", dataclasses.replace(kinds.MIXERS["attention"], checks=("made:up",)))
    with pytest.raises(C.ConfigError, match="made-up problem"):
        C.load(["base.yml", "model_name=tiny", "qk_rope_head_dim=3"])
    C.load(["base.yml", "model_name=tiny-deepseek", "qk_rope_head_dim=32"])  # no attention layer: not its problem
    assert calls == [("llama2", True), ("deepseek", False)]
