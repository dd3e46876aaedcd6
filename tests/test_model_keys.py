"""schema.MODEL_KEYS, the model's keys declared once: the recipe.yml `hf import` writes describes the
model its checkpoint holds (every model key as the checkpoint's metadata records it), and the
checkpoint fits the model that recipe builds, for every family's shrunk preset (exported, then
imported) and every random transformers model the bridge tests build (tests/hf_models.py). Before,
recipe.yml was written from a hand-kept list without the delta-net keys: a Qwen3.5 or Qwen3-Next
recipe trained another model. One recipe (Qwen3.5, the journey that failed) trains a step."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers

from maxlite import config as C
from maxlite.bridge import hf
from maxlite.checkpoints.params import verified_meta
from maxlite.checkpoints.restore import check_compatible, saved_tree
from maxlite.schema import MODEL_KEYS
from maxlite.state import abstract_params
from maxlite.train import train
from tests import hf_models
from tests.helpers import preset_names, shrunk

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _family_presets() -> dict[str, str]:
    """One preset per family (the first by name)."""
    out: dict[str, str] = {}
    for name in preset_names():
        out.setdefault(C.load(["base.yml", f"model_name={name}"]).decoder_block, name)
    return out


PRESETS = _family_presets()
CASES = [f"preset:{name}" for name in PRESETS.values()] + [f"hf:{name}" for name in hf_models.CONFIGS]


def _hf_dir(case: str, path) -> str:
    """An HF directory of the case: a preset's shrunk model exported (zero weights: only the keys and
    shapes matter here), or a random transformers model saved."""
    kind, name = case.split(":", 1)
    if kind == "preset":
        cfg = C.load(shrunk(name))
        zeros = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params(cfg)[1])
        hf.export_hf(cfg, zeros, str(path), tokenizer="none")
    else:
        torch.manual_seed(0)
        hf_models.auto_class(name).from_config(hf_models.config(name)).save_pretrained(str(path))
    return str(path)


def _import(case: str, tmp_path) -> str:
    ck = str(tmp_path / "ck")
    assert hf.main(["import", _hf_dir(case, tmp_path / "hf"), ck, "max_target_length=32"]) == 0
    return ck


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """`_import` once per case for the module: the tests after the first only read the checkpoint
    (a run of its recipe restores from it, writes in its own directory)."""
    done: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in done:
            done[case] = _import(case, tmp_path_factory.mktemp(case.replace(":", "_")))
        return done[case]
    return get


@pytest.mark.parametrize("case", CASES)
def test_the_recipe_of_an_import_is_the_model_of_its_checkpoint(case, imported):
    ck = imported(case)
    recipe = C.load([f"{ck}/recipe.yml"])
    saved = verified_meta(ck, 0)["config"]
    mine = C.to_plain_dict(recipe)
    assert {k: mine[k] for k in MODEL_KEYS} == {k: saved[k] for k in MODEL_KEYS}
    # what a run of the recipe restores (maxlite.resume's check, before any compile)
    check_compatible(saved_tree(ck, 0, "params"), abstract_params(recipe)[1], f"{ck}/0", mine)


def test_a_qwen3_5_import_trains_from_its_recipe(tmp_path, monkeypatch, imported):
    """The journey that failed ("parameter 'layers/blocks/0/attn/A_log' is (1, 4) there but (1, 32)
    here"): import, then a step of a plain run of the recipe, from the imported weights."""
    _trains_from_its_recipe(imported("hf:qwen3_5_text"), tmp_path, monkeypatch)


def test_a_kimi_linear_import_trains_from_its_recipe(tmp_path, monkeypatch, imported):
    """Kimi delta attention's parameters (the delta-net's dims, its own gates) and NoPE latent
    attention: imported, then a step of a plain run of the recipe, from the imported weights."""
    _trains_from_its_recipe(imported("hf:kimi_linear"), tmp_path, monkeypatch)


def _trains_from_its_recipe(ck: str, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [f"{ck}/recipe.yml", "steps=1", "max_target_length=16", "per_device_batch_size=1", "run_name=r",
            "enable_checkpointing=false", "enable_tensorboard=false", "write_report=false"]
    result = train(C.load(argv))
    assert result["exit_code"] == 0
    status = json.loads((tmp_path / "runs" / "r" / "status.json").read_text())
    assert status["resumed_from"]["source"] == "params" and status["step"] == 1


def test_a_checkpoint_of_another_model_is_told_by_its_model_keys(imported):
    """The fit check names the model keys that differ, and what to do."""
    ck = imported("hf:qwen3_5_text")
    recipe = C.load([f"{ck}/recipe.yml", "gdn_num_value_heads=8"])
    with pytest.raises(C.ConfigError) as misfit:
        check_compatible(saved_tree(ck, 0, "params"), abstract_params(recipe)[1], f"{ck}/0",
                         C.to_plain_dict(recipe))
    assert "gdn_num_value_heads=4 there, 8 here" in str(misfit.value)
