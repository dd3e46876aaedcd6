"""Every family's numbers, held across refactors of the decoder layer: one shrunk preset per family
(helpers.shrunk, float32), its parameter tree (paths, shapes, dtypes: what a saved checkpoint must
match to restore), the bytes of its initial parameters, and the losses of its first two training
steps on a fixed synthetic batch, computed with XLA's default code generation (what users run).

The seven older families' entries were written before the decoder layer became mixer + feed-forward
kinds; every family has its scanned stack, and two have their unrolled one too: the unrolled path
runs the same Block, mixer and feed-forward modules one by one, and what it has of its own (the
per-layer loop, static local/global flags, the list of layers in the tree) no family owns. Gemma 3's
unrolled entry pins the loop with its local and global layers, Mixtral's with a mixture of experts;
an unrolled case costs a family's compile again (deepseek 66 s scanned, 66 s unrolled on the loaded
2-core machine), and the five other older families' unrolled entries ran the same loop over layers
their scanned entries already pin (dropped to shorten the suite). The Qwen MoE hybrids run two layers of their
own pattern (OVERRIDES). Update the table ONLY when a change is meant to alter a family's parameters
or numerics, by running `MAXLITE_WRITE_TABLE=1 pytest tests/test_family_table.py`, and say why in
the commit: the write keeps every entry whose numbers still pass (its bytes unchanged) and writes the
new and the changed ones. The one subprocess computes only the cases selected (`-k deepseek` computes
deepseek's; with the write, writes only its entry).

Tree and parameter bytes must be identical on every CPU (the initialisation is counter-based random
numbers). The losses are compared to 1e-6 relative: float32 sums reorder between CPUs' kernels (an
AVX2-only CPU and one with AVX-512 differ in the last bits), and a few hundred products of O(1)
terms in float32 (epsilon 1.2e-7) stay well inside that; a changed layer moves them by far more.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from maxlite import config as C
from maxlite.models.families import FAMILIES
from maxlite.models.kinds import layer_kinds
from tests.helpers import ROOT, process_env, selected_params, shrunk
from tests.xla_flags import CHEAP_COMPILE

TABLE = pathlib.Path(__file__).parent / "data" / "family_table.json"
# every test waits for the one subprocess (the fixture's time counts as the first test's): 23 compiles
# with XLA's default code generation took over 600 s (pytest's default limit) with the 2 cores loaded 12×
TIMEOUT_S = 1800
pytestmark = pytest.mark.timeout(TIMEOUT_S)

# one preset per family, shrunk with its traits (MoE layouts included): the smallest of the older
# families; of the newer, the one with the most of its family's traits (TRAITS below)
PRESETS = {"llama2": "tiny", "gpt3": "gpt3-126m", "qwen2": "qwen2.5-0.5b", "qwen3": "qwen3-0.6b",
           "gemma3": "gemma3-1b", "mixtral": "tiny-moe", "qwen3_moe": "qwen3-30b-a3b",
           "deepseek": "deepseek-v3", "deepseek_v32": "deepseek-v3.2", "glm_moe_dsa": "glm-5", "gpt_oss": "gpt-oss-20b", "gemma4": "gemma4-tiny",
           "gemma4_moe": "gemma4-26b-a4b", "glm4_moe": "glm-4.5", "olmo3": "olmo3-7b", "mistral4": "mistral-small-4-119b", "minimax_m2": "minimax-m2", "qwen3_5": "qwen3.5-27b",
           "qwen3_5_moe": "qwen3.5-35b-a3b", "qwen3_next": "qwen3-next-80b-a3b", "qwen3_vl": "qwen3-vl-2b", "qwen3_vl_moe": "qwen3-vl-30b-a3b",
           "kimi_linear": "kimi-linear-48b-a3b",
           "nemotron_h": "nemotron-h-8b",
           "llama4": "llama4-scout-17b-16e", "deepseek_v4": "deepseek-v4-flash"}
# the MoE hybrids: two layers of their own pattern (as their checkpoints' `layer_types` state it, and
# as tests/hf_models.py builds them): one delta-net layer compiles for the MoE feed-forward what
# qwen3_5's whole 3 : 1 period compiles again (a delta-net layer is the table's costliest compile)
OVERRIDES = {fam: ["base_num_decoder_layers=2", "layer_types=[linear_attention, full_attention]"]
             for fam in ("qwen3_5_moe", "qwen3_next", "kimi_linear")}
# Llama 4: Scout's layer (the q/k norm) with Maverick's dense and MoE layers in turn
OVERRIDES["llama4"] = ["interleave_moe_layer_step=2"]
UNROLLED = ("gemma3", "mixtral")
CASES = [f"{fam}/{form}" for fam in PRESETS for form in (("scan", "unrolled") if fam in UNROLLED else ("scan",))]
# what each newer family's shrunk preset must keep for its entry to cover the family
TRAITS = {
    "deepseek": lambda c, kinds: c.attention_type == "mla" and c.q_lora_rank > 0 and c.mtp_num_layers > 0
    and c.n_routing_groups > 1 and c.rope_scaling_type == "yarn" and [k.ffn for k in kinds] == ["dense", "moe"],
    "deepseek_v32": lambda c, kinds: c.q_lora_rank > 0 and c.index_topk < c.max_target_length
    and c.index_head_dim > c.qk_rope_head_dim and [(k.mixer, k.ffn) for k in kinds] == [("dsa", "dense"), ("dsa", "moe")],
    "glm_moe_dsa": lambda c, kinds: c.q_lora_rank > 0 and c.index_topk < c.max_target_length
    and c.n_routing_groups < 1 and [(k.mixer, k.ffn) for k in kinds] == [("dsa", "dense"), ("dsa", "moe")],
    "gpt_oss": lambda c, kinds: c.attention_sink and c.mlp_activations_limit > 0 and c.router_logit_bias
    and {k.variant for k in kinds} == {"local", "global"},
    "gemma4": lambda c, kinds: c.per_layer_embed_dim > 0 and c.num_kv_shared_layers > 0 and c.attention_k_eq_v
    and c.use_double_wide_mlp and {k.variant for k in kinds} == {"local", "global"},
    "gemma4_moe": lambda c, kinds: c.num_experts > 0 and c.attention_k_eq_v
    and {k.variant for k in kinds} == {"local", "global"},
    "glm4_moe": lambda c, kinds: c.use_qk_norm and c.use_bias and c.partial_rotary_factor < 1
    and c.routed_bias and [k.ffn for k in kinds] == ["dense", "moe"],
    "olmo3": lambda c, kinds: {k.variant for k in kinds} == {"local", "global"},
    "mistral4": lambda c, kinds: c.attention_type == "mla" and c.q_lora_rank > 0 and c.routed_score_func == "softmax"
    and not c.routed_bias and c.shared_experts > 0 and {k.ffn for k in kinds} == {"moe"},
    "minimax_m2": lambda c, kinds: c.routed_score_func == "sigmoid" and c.routed_bias and c.partial_rotary_factor < 1
    and c.shared_experts == 0 and {k.ffn for k in kinds} == {"moe"},
    "qwen3_5": lambda c, kinds: [k.mixer for k in kinds] == ["gated_deltanet"] * 3 + ["attention"],
    "qwen3_5_moe": lambda c, kinds: c.shared_expert_gate and c.num_experts > 0
    and [k.mixer for k in kinds] == ["gated_deltanet", "attention"],
    "qwen3_next": lambda c, kinds: c.shared_expert_gate and c.num_experts > 0
    and [k.mixer for k in kinds] == ["gated_deltanet", "attention"],
    "kimi_linear": lambda c, kinds: c.attention_type == "mla" and c.routed_bias and c.shared_experts > 0
    and [(k.mixer, k.ffn) for k in kinds] == [("kda", "dense"), ("mla", "moe")],
    "llama4": lambda c, kinds: c.use_qk_norm and c.temperature_tuning and c.routed_weight_on_input
    and [(k.variant, k.ffn) for k in kinds] == [("chunked", "dense"), ("chunked", "moe"), ("chunked", "dense"),
                                                ("global", "moe")],
    "qwen3_vl": lambda c, kinds: c.vision_encoder == "qwen_vit" and len(c.mrope_sections) == 3
    and bool(c.vision_deepstack_layers),
    "qwen3_vl_moe": lambda c, kinds: c.vision_encoder == "qwen_vit" and len(c.mrope_sections) == 3
    and bool(c.vision_deepstack_layers) and c.num_experts > 0 and {k.ffn for k in kinds} == {"moe"},
    "deepseek_v4": lambda c, kinds: c.hc_mult > 1 and c.routed_score_func == "sqrtsoftplus" and c.routed_bias
    and c.mlp_activations_limit > 0 and c.o_groups > 1 and c.index_topk < c.max_target_length // c.compress_rate_csa
    and c.compress_rate_hca < c.max_target_length
    and [(k.mixer, k.ffn) for k in kinds] == [("v4_sliding", "hash_moe"), ("v4_hca", "moe"), ("v4_csa", "moe")],
    "nemotron_h": lambda c, kinds: [(k.mixer, k.ffn) for k in kinds] == [("mamba2", "none"), ("attention", "none"),
                                                                          ("none", "dense")],
}


def _argv(fam: str) -> list[str]:
    """The family's shrunk preset with its overrides."""
    return shrunk(PRESETS[fam]) + OVERRIDES.get(fam, [])


def _assert_same(got: dict, expected: dict):
    assert (got["tree"], got["leaves"]) == (expected["tree"], expected["leaves"]), "parameter tree changed"
    assert got["params"] == expected["params"], "initial parameters changed"
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-6)


def _passes(got: dict, expected: dict) -> bool:
    try:
        _assert_same(got, expected)
        return True
    except AssertionError:
        return False


@pytest.fixture(scope="module")
def computed(request) -> dict:
    """The subprocess's report (tests/family_numbers.py, one process with XLA's default code
    generation: the table holds XLA's output bytes, which the tests' cheaper compile would compute in
    other last bits): its XLA_FLAGS and the numbers of the selected cases (all, unless `pytest -k`)."""
    cases = {key: _argv(key.split("/")[0]) for key in selected_params(request, "case")}
    done = subprocess.run([sys.executable, "-m", "tests.family_numbers", json.dumps(cases)], cwd=ROOT,
                          env=process_env(8, cheap_compile=False), capture_output=True, text=True,
                          timeout=TIMEOUT_S - 60)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.environ.get("MAXLITE_WRITE_TABLE") != "1", reason="writes the table")
def test_write_table(computed):
    """The computed cases' entries (all, or those `pytest -k` selects), in CASES order."""
    old, table = json.loads(TABLE.read_text()) if TABLE.exists() else {}, {}
    for key in CASES:
        got, had = computed["cases"].get(key), old.get(key)
        if got is not None and (had is None or not _passes(got, had)):
            table[key] = got
        elif had is not None:
            table[key] = had  # not computed, or still passes: its bytes stay as they are
    TABLE.write_text(json.dumps(table, indent=1) + "\n")


def test_the_table_is_computed_with_xla_defaults(computed):
    flags = computed["xla_flags"].split()
    assert not set(flags) & set(CHEAP_COMPILE.split()) and flags == ["--xla_force_host_platform_device_count=8"], flags


def test_every_family_has_a_preset_that_keeps_its_traits():
    assert set(PRESETS) == set(FAMILIES)
    for fam, keeps in TRAITS.items():
        cfg = C.load(_argv(fam))
        assert keeps(cfg, layer_kinds(cfg)), fam


@pytest.mark.parametrize("case", CASES, ids=[key.replace("/", "-") for key in CASES])
def test_family_numbers_unchanged(case, computed):
    fam = case.split("/")[0]
    assert C.load(_argv(fam)).decoder_block == fam
    _assert_same(computed["cases"][case], json.loads(TABLE.read_text())[case])
