"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's layers (DeepSeek sparse attention over latent attention,
DeepSeekMoE) with the indexer's RoPE on interleaved pairs, which the import's permutation absorbs.

A random model built by transformers (tests/hf_models.py: each query keeps the indexer's best 6
tokens) imports, gives float32 logits within 1e-5 relative over 40 tokens (the same tensors imported
without the permutation do not: the indexer chooses other tokens), decodes greedily to transformers'
own tokens (a batch of prompts of different lengths equal to each alone) and exports so that
transformers loads a GlmMoeDsaForCausalLM with the same logits. Cross-layer top-k sharing ("shared"
indexer layers) is refused in one line."""

import json

import numpy as np
import pytest
import torch
import transformers

from maxlite.bridge import hf
from tests.helpers import assert_greedy_like_transformers, imported_random_model, jax_logits, relative, torch_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 256


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(the transformers model, its directory, maxlite's import of it)."""
    return imported_random_model(tmp_path_factory, "glm_moe_dsa", ["max_target_length=64"])


def test_import_gives_transformers_logits_through_the_interleaved_indexer(imported, monkeypatch):
    from maxlite.families.deepseek_v32 import hf as v32
    from maxlite.families.glm_moe_dsa import hf as glm
    from maxlite.models.layout import layer_kinds

    model, path, cfg, pure = imported
    assert cfg.decoder_block == "glm_moe_dsa" and (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (6, 16, 16)
    assert [(k.mixer, k.ffn) for k in layer_kinds(cfg)] == [("dsa", "dense"), ("dsa", "moe"), ("dsa", "moe")]
    ids = np.random.default_rng(1).integers(0, V, (2, 40))
    theirs = torch_logits(model, ids)
    assert relative(jax_logits(cfg, pure, ids), theirs) <= 1e-5
    # DeepSeek-V3.2's indexer tensors as they are (split halves) choose other tokens
    monkeypatch.setattr(glm, "indexer_maps", v32.indexer_maps)
    unpermuted_cfg, unpermuted = hf.import_hf(str(path / "hf"), ["max_target_length=64"])
    assert relative(jax_logits(unpermuted_cfg, unpermuted, ids), theirs) > 1e-2


def test_greedy_decoding_equals_transformers_and_a_batch_equals_each_alone(imported):
    model, _, cfg, pure = imported
    assert_greedy_like_transformers(cfg, pure, model, 32, [list(range(100, 120)), [7, 8, 9]], alone=True)


def test_export_loads_in_transformers_with_the_same_logits(imported):
    model, path, cfg, pure = imported
    hf.export_hf(cfg, pure, str(path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    assert back.config.indexer_types == model.config.indexer_types == ["full"] * 3
    assert (back.config.index_topk, back.config.index_n_heads, back.config.index_head_dim) == (6, 16, 16)
    ids = np.random.default_rng(2).integers(0, V, (1, 40))
    assert relative(torch_logits(back, ids), torch_logits(model, ids)) <= 1e-6


def test_shared_indexer_layers_are_refused_in_one_line(imported, tmp_path):
    _, path, _, _ = imported
    config = json.loads((path / "hf" / "config.json").read_text())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "indexer_types": ["full", "shared", "full"]}))
    with pytest.raises(ValueError) as err:
        hf.import_hf(str(tmp_path / "hf"))
    assert str(err.value) == ("config.json: indexer_types has layers [1] reusing an earlier layer's top-k "
                              "(\"shared\"): maxlite's GLM-5 runs its own indexer in every layer (\"full\")")
