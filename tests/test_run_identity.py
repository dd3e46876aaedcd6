"""maxlite/run_identity.py: runs of recipes that cannot share a run never land in one run directory,
and the same command run again still resumes its own run."""

from __future__ import annotations

import json
import os

import pytest

from maxlite import config as C
from maxlite.train import train
from tests import helpers

SMALL = [*helpers.SMALL, "checkpoint_period=2"]


def _status(run_dir: str) -> dict:
    with open(f"{run_dir}/status.json") as f:
        return json.load(f)


def test_a_new_users_session_in_an_empty_directory(tmp_path, monkeypatch):
    """Synthetic data, then the same command with text data (before: it resumed the synthetic run
    and died in the data iterator's set_state), then a changed model shape under the first run's
    name (refused in one line, nothing written), then the first command for longer (resumes)."""
    monkeypatch.chdir(tmp_path)
    first = [*SMALL, "steps=2"]
    assert train(C.load(first))["exit_code"] == 0
    synthetic = C.load(first).run_dir
    assert synthetic == str(tmp_path / "runs" / "base_tiny")

    text = [*SMALL, "dataset_type=text", "vocab_size=4096", "steps=2"]
    assert C.load(text).run_dir != synthetic  # another data source: another run
    assert train(C.load(text))["exit_code"] == 0
    assert _status(C.load(text).run_dir)["resumed_from"]["source"] == "fresh"

    before = {name: os.path.getmtime(os.path.join(synthetic, name)) for name in os.listdir(synthetic)}
    deeper = [*first, "base_num_decoder_layers=3", "run_name=base_tiny"]
    with pytest.raises(C.ConfigError) as refused:
        train(C.load(deeper))
    line = str(refused.value)
    assert "\n" not in line and "base_num_decoder_layers=2 there, 3 here" in line and "run_name=base_tiny-" in line
    assert {name: os.path.getmtime(os.path.join(synthetic, name)) for name in os.listdir(synthetic)} == before

    suggested = line.split("run_name=")[1].split()[0]
    assert C.load([*deeper[:-1], f"run_name={suggested}"]).run_dir != synthetic

    assert train(C.load([*SMALL, "steps=3"]))["exit_code"] == 0  # the first command, longer: it goes on
    resumed = _status(synthetic)["resumed_from"]
    assert (resumed["source"], resumed["step"]) == ("checkpoint", 2)


@pytest.mark.parametrize("argv, name", [
    ([], "base_tiny"),
    (["dataset_type=synthetic"], "base_tiny"),  # the recipe's own value changes nothing
    (["steps=7", "learning_rate=1e-4"], "base_tiny"),  # a run may change these and go on
    (["dataset_type=text"], "base_tiny_text"),
    (["dataset_type=sft", "lora_rank=16"], "base_tiny_sft_lora16"),
    (["dataset_type=preference", "train_objective=dpo"], "base_tiny_preference_dpo"),
])
def test_the_default_name_tells_data_objective_and_lora_apart(argv, name):
    assert C.load(["base.yml", "model_name=tiny", *argv]).run_name == name


def test_other_files_get_another_name_the_same_files_the_same():
    one = C.load(["base.yml", "model_name=tiny", "dataset_type=text", "dataset_path=a.jsonl"]).run_name
    assert one.startswith("base_tiny_text-") and one != "base_tiny_text"
    assert C.load(["base.yml", "model_name=tiny", "dataset_type=text", "dataset_path=a.jsonl"]).run_name == one
    assert C.load(["base.yml", "model_name=tiny", "dataset_type=text", "dataset_path=b.jsonl"]).run_name != one
    assert C.load(["demo.yml"]).run_name == "demo_tiny"  # a recipe that sets its data names it already


def _zeros(cfg):
    """A params-only checkpoint's weights for `cfg` (zeros: what is checked here is where a run starts)."""
    import jax
    import numpy as np

    from maxlite.state import abstract_params
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params(cfg)[1])


def test_a_run_that_never_saved_binds_nothing_its_data_fixed(tmp_path, monkeypatch, capsys):
    """A run on an empty file fails in one line, after its directory was opened; the same command with
    the data fixed trains there (before: refused as another recipe's run, which held nothing)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "good.jsonl").write_text('{"text": "In the beginning God created the heaven and the earth."}\n' * 50)
    command = [*SMALL, "dataset_type=text", "vocab_size=4096", "steps=1", "run_name=r"]
    with pytest.raises(C.ConfigError, match="no documents"):
        train(C.load([*command, "dataset_path=empty.jsonl"]))
    run_dir = tmp_path / "runs" / "r"
    assert (run_dir / "config.yml").is_file()  # what bound it before
    capsys.readouterr()
    assert train(C.load([*command, "dataset_path=good.jsonl"]))["exit_code"] == 0
    replaced = [line for line in capsys.readouterr().out.splitlines() if "never saved" in line]
    assert len(replaced) == 1 and "dataset_path=" in replaced[0], replaced
    assert _status(str(run_dir))["resumed_from"]["source"] == "fresh"
    # the failed run's records moved aside, not mixed into the new run's
    aside = [d for d in run_dir.iterdir() if d.name.startswith("replaced-")]
    assert len(aside) == 1 and str(aside[0]) in replaced[0], (aside, replaced)
    assert "empty.jsonl" in (aside[0] / "config.yml").read_text()
    assert "good.jsonl" in (run_dir / "config.yml").read_text()


def test_a_run_that_never_saved_binds_nothing_its_checkpoint_fixed(tmp_path, monkeypatch, capsys):
    """A checkpoint of a 3-layer model named as the start of a 2-layer run: refused in one line that
    names the model key to set; the command with the key set trains there from those weights."""
    monkeypatch.chdir(tmp_path)
    from maxlite import checkpoints

    deeper = C.load([*SMALL, "base_num_decoder_layers=3"])
    checkpoints.save_params(str(tmp_path / "ck"), deeper, _zeros(deeper))
    command = [*SMALL, "steps=1", "run_name=r", f"load_parameters_path={tmp_path / 'ck'}"]
    with pytest.raises(C.ConfigError) as misfit:
        train(C.load(command))
    line = str(misfit.value)
    assert "\n" not in line and "base_num_decoder_layers=3 there, 2 here" in line, line
    capsys.readouterr()
    assert train(C.load([*command, "base_num_decoder_layers=3"]))["exit_code"] == 0
    assert sum("never saved" in line for line in capsys.readouterr().out.splitlines()) == 1
    assert _status(str(tmp_path / "runs" / "r"))["resumed_from"]["source"] == "params"


def test_what_trains_is_part_of_the_recipe():
    """DeepSeek sparse attention's dense warm-up (the indexers alone) and a vision tower's training
    choice name runs of their own: their optimizer state holds other parameters."""
    from maxlite.run_identity import differences

    warm = C.load(["base.yml", "model_name=deepseek-v3.2", "index_stage=dense_warmup"])
    sparse = C.load(["base.yml", "model_name=deepseek-v3.2"])
    assert (warm.run_name, sparse.run_name) == ("base_deepseek-v3.2_dense_warmup", "base_deepseek-v3.2")
    assert differences(C.to_plain_dict(warm), C.to_plain_dict(sparse)) == ["index_stage"]
    assert C.load(["base.yml", "model_name=qwen3-vl-2b", "vision_train=all"]).run_name == "base_qwen3-vl-2b_vision-all"
