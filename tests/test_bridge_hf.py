"""HF Llama export/import: transformers loads what we write and agrees on logits; round trips are bit-exact."""

import functools
import json
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest
import safetensors
import torch
import transformers

from maxlite import config as C, schema
from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.families.llama2 import hf as llama2
from maxlite.bridge.safetensors_io import SafetensorsDir, parse_size
from tests import hf_models
from tests.helpers import jax_logits

T = 40

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = {
    # tiny: GQA (4 query heads, 2 kv heads), untied, stacked layers
    "tiny": ["model_name=tiny"],
    # Llama 3.1/3.2 style: llama3 RoPE scaling, tied embeddings, attention biases, per-layer params
    "llama3-tied-bias": ["model_name=tiny", "rope_scaling_factor=8.0", "rope_original_max_position=16",
                         "rope_max_timescale=500000", "logits_via_embedding=true", "use_bias=true",
                         "scan_layers=false", "normalization_layer_epsilon=1e-6"],
}


@functools.lru_cache(maxsize=None)
def make(case, seed=0):
    """A float32 config and random params with non-trivial norm scales and biases (read-only)."""
    cfg = C.load(["base.yml", "dtype=float32", *CASES[case]])
    return cfg, P.random_params(cfg, seed)


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_loads_export_and_logits_match(case, tmp_path):
    cfg, pure = make(case)
    hf.export_hf(cfg, pure, str(tmp_path))
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, T))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    ours = jax_logits(cfg, pure, ids)
    assert np.abs(theirs - ours).max() <= 1e-4, np.abs(theirs - ours).max()
    # the config transformers parsed is the model we meant (not a default it fell back to)
    assert model.config.num_key_value_heads == cfg.base_num_kv_heads
    assert model.config.tie_word_embeddings == cfg.logits_via_embedding
    if cfg.rope_scaling_factor:
        assert model.config.rope_parameters["rope_type"] == "llama3"
        assert model.config.rope_parameters["factor"] == 8.0


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_bit_exact_float32_across_shards(case, tmp_path):
    cfg, pure = make(case)
    names = hf.export_hf(cfg, pure, str(tmp_path), max_shard_size="300KB")
    assert len(names) > 3 and (tmp_path / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(names)
    cfg2, pure2 = hf.import_hf(str(tmp_path), [f"scan_layers={str(cfg.scan_layers).lower()}"])
    for key in ("base_emb_dim", "base_num_kv_heads", "rope_scaling_factor", "rope_original_max_position",
                "rope_max_timescale", "logits_via_embedding", "use_bias", "normalization_layer_epsilon"):
        assert getattr(cfg2, key) == getattr(cfg, key), key
    got = dict(P.leaves(pure2))
    assert set(got) == {p for p, _ in P.leaves(pure)}
    for path, value in P.leaves(pure):
        assert got[path].dtype == np.float32 and np.array_equal(got[path], value), path


def test_files_read_by_the_safetensors_library(tmp_path):
    cfg, pure = make("tiny")
    hf.export_hf(cfg, pure, str(tmp_path), max_shard_size="1MB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    seen = 0
    for name in sorted(set(index["weight_map"].values())):
        with safetensors.safe_open(str(tmp_path / name), framework="pt") as f:
            for key in f.keys():
                seen += 1
                if key == "model.layers.2.self_attn.q_proj.weight":
                    q = P.get(pure, ("layers", "attn", "q"))[2]  # [D, N, H]
                    np.testing.assert_array_equal(f.get_tensor(key).numpy(), q.reshape(256, -1).T)
    assert seen == 3 + 9 * cfg.base_num_decoder_layers
    assert index["metadata"]["total_size"] == sum(v.nbytes for _, v in P.leaves(pure))


def test_bfloat16_export_rounds_like_torch(tmp_path):
    cfg, pure = make("tiny")
    hf.export_hf(cfg, pure, str(tmp_path), dtype="bfloat16")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    up = P.get(pure, ("layers", "mlp", "up"))[1]
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        got = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(up.T)).to(torch.bfloat16))
    _, back = hf.import_hf(str(tmp_path))  # bfloat16 → float32 on import is exact
    np.testing.assert_array_equal(P.get(back, ("layers", "mlp", "up"))[1],
                                  up.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_import_of_a_transformers_written_model_matches_its_logits(tmp_path):
    model = hf_models.model("llama")  # one kv head, Llama 3 RoPE scaling (tests/hf_models.py)
    model.save_pretrained(str(tmp_path))
    cfg, pure = hf.import_hf(str(tmp_path), ["dtype=float32", "max_target_length=64"])
    assert (cfg.base_num_kv_heads, cfg.head_dim, cfg.rope_scaling_factor) == (1, 32, 32.0)
    ids = np.random.default_rng(2).integers(0, 300, (2, T))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(jax_logits(cfg, pure, ids) - theirs).max() <= 1e-4


def test_config_json_readable_by_old_and_new_transformers(tmp_path):
    cfg, _ = make("llama3-tied-bias")
    config = llama2.hf_config(cfg, "float32", bos_id=1, eos_id=2)
    # transformers 4.x reads rope_scaling (with `type` before 4.43), rope_theta and torch_dtype
    assert config["rope_scaling"]["type"] == config["rope_scaling"]["rope_type"] == "llama3"
    assert config["rope_theta"] == 500000.0 and config["torch_dtype"] == "float32"
    # transformers 5.x: rope_parameters and dtype
    assert config["rope_parameters"]["rope_theta"] == 500000.0 and config["dtype"] == "float32"
    assert config["max_position_embeddings"] > config["rope_scaling"]["original_max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    parsed = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert parsed.rope_parameters["factor"] == 8.0 and parsed.head_dim == 64
    assert llama2.config_overrides(config)["rope_low_freq_factor"] == 1.0
    assert llama2.hf_config(C.load(["base.yml", "model_name=tiny"]))["rope_scaling"] is None


GPT3 = ["decoder_block=gpt3", "base_emb_dim=128", "base_num_decoder_layers=2", "base_num_query_heads=4",
        "base_num_kv_heads=4", "base_mlp_dim=512", "head_dim=32", "vocab_size=512",
        "max_position_embeddings=128", "max_target_length=64", "use_bias=true"]


@pytest.mark.parametrize("tied", [True, False])
def test_gpt3_block_exports_as_gpt2(tied, tmp_path):
    cfg = C.load(["base.yml", "dtype=float32", *GPT3, f"logits_via_embedding={str(tied).lower()}"])
    pure = P.random_params(cfg, seed=4)
    hf.export_hf(cfg, pure, str(tmp_path), max_shard_size="200KB")
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, T))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(theirs - jax_logits(cfg, pure, ids)).max() <= 1e-4
    cfg2, back = hf.import_hf(str(tmp_path), ["max_target_length=64"])
    assert cfg2.decoder_block == "gpt3" and cfg2.logits_via_embedding == tied
    got = dict(P.leaves(back))
    assert set(got) == {p for p, _ in P.leaves(pure)}
    for path, value in P.leaves(pure):
        assert np.array_equal(got[path], value), path


def test_import_of_a_transformers_written_gpt2_matches_its_logits(tmp_path):
    model = hf_models.model("gpt2")  # tests/hf_models.py
    model.save_pretrained(str(tmp_path))
    cfg, pure = hf.import_hf(str(tmp_path), ["dtype=float32", "max_target_length=64"])
    assert (cfg.decoder_block, cfg.base_mlp_dim, cfg.head_dim, cfg.logits_via_embedding) == ("gpt3", 256, 16, True)
    ids = np.random.default_rng(2).integers(0, 200, (2, T))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(jax_logits(cfg, pure, ids) - theirs).max() <= 1e-4


def test_what_has_no_hf_equivalent_is_refused_in_one_line(tmp_path):
    gqa = C.load(["base.yml", *GPT3, "base_num_kv_heads=2"])
    with pytest.raises(ValueError, match="GPT-2 export needs kv heads = heads"):
        hf.export_hf(gqa, P.random_params(gqa), str(tmp_path))
    assert not list(tmp_path.iterdir())  # refused before writing anything
    tiny, pure = make("tiny")
    hf.export_hf(tiny, pure, str(tmp_path / "once"))
    with pytest.raises(ValueError, match="already holds model.safetensors: export into a new or empty"):
        hf.export_hf(tiny, pure, str(tmp_path / "once"), max_shard_size="1MB")


def test_import_errors_are_one_line(tmp_path):
    with pytest.raises(C.ConfigError, match="no config.json"):
        hf.import_hf(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(C.ConfigError, match="model_type='bert' has no maxlite equivalent"):
        hf.import_hf(str(tmp_path))


def test_a_converter_bug_keeps_its_traceback(tmp_path, monkeypatch):
    """The user's mistakes are one line and exit 2; an error inside the conversion is a bug: it
    reaches the caller whole (its traceback), not a line that hides where it came from."""
    from maxlite import checkpoints

    cfg, pure = make("tiny")
    checkpoints.save_params(str(tmp_path / "ckpt"), cfg, P.to_state(cfg, pure), step=7)
    assert hf.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0

    def bug(*args, **kwargs):
        raise ValueError("cannot reshape array of size 12 into shape (5,)")  # what a slip in a map raises

    monkeypatch.setattr(hf.hf_convert, "pieces", bug)  # raised inside Orbax's writer thread
    with pytest.raises(ValueError, match="cannot reshape") as e:
        hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "back")])
    assert not isinstance(e.value, C.ConfigError)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("300KB") == 300_000 and parse_size(123) == 123
    with pytest.raises(ValueError, match="--max-shard-size"):
        parse_size("five")


def test_cli_export_then_import_through_checkpoints(tmp_path, capsys):
    from maxlite import checkpoints

    cfg, pure = make("tiny")
    checkpoints.save_params(str(tmp_path / "ckpt"), cfg, P.to_state(cfg, pure), step=7)
    assert hf.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "2MB"]) == 0
    assert SafetensorsDir(tmp_path / "hf").names()
    assert hf.main(["import", str(tmp_path / "hf"), str(tmp_path / "back"), "scan_layers=true"]) == 0
    cfg2, params2 = checkpoints.load_params(str(tmp_path / "back"))
    # the import leaves a ready recipe beside the weights: same model, pointing at them
    recipe = C.load([str(tmp_path / "back" / "recipe.yml")])
    assert recipe.load_parameters_path == str(tmp_path / "back")
    for key in schema.MODEL_KEYS:
        assert getattr(recipe, key) == getattr(cfg, key) == getattr(cfg2, key), key
    got = dict(P.leaves(P.to_pure(params2)))
    for path, value in P.leaves(pure):
        assert np.array_equal(got[path], value), path
    capsys.readouterr()
    assert hf.main(["import", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"maxlite: error: {tmp_path / 'nothing'}: no config.json (is this a Hugging Face model directory?)"]


def test_export_ships_the_recipe_tokenizer(tmp_path):
    from maxlite.data.tokenizer import load_tokenizer

    cfg = C.load(["base.yml", "model_name=tiny", "dataset_type=text", "base_num_decoder_layers=1"])
    hf.export_hf(cfg, P.random_params(cfg), str(tmp_path))  # --tokenizer auto: the bundled one
    ours = load_tokenizer("")
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ours.bos_id, ours.eos_id)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "In the beginning God created the heaven and the earth."
    assert theirs(text)["input_ids"] == ours.encode_batch([text])[0].tolist()
    assert theirs.eos_token_id == ours.eos_id
    hf.export_hf(cfg, P.random_params(cfg), str(tmp_path / "bare"), tokenizer="none")
    assert not (tmp_path / "bare" / "tokenizer.json").exists()


@pytest.mark.slow
def test_export_memory_stays_near_one_tensor(tmp_path):
    """Peak memory an export adds beyond the params it converts: about its largest tensor (the
    embedding), far from a second copy of the model. Measured in a fresh process (VmHWM)."""
    import subprocess
    import sys

    bench = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_bridge.py"
    out = subprocess.run([sys.executable, str(bench), "--child", "export", "--dir", str(tmp_path),
                          "--layers", "8", "--dim", "512"], check=True, capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["model_mib"] > 3 * r["largest_tensor_mib"]  # a model where one tensor ≠ the model
    assert r["peak_added_beyond_result_mib"] < 1.3 * r["largest_tensor_mib"], r


def _hf_dir_with_tokenizer(path: pathlib.Path, vocab_size: int) -> pathlib.Path:
    """A transformers-written Llama 3.2-style model (long context) with its own tokenizer and chat template."""
    from maxlite.data.tokenizer import BUNDLED_DIR

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=vocab_size, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    transformers.LlamaForCausalLM(config).save_pretrained(str(path))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(BUNDLED_DIR / "tokenizer.json"),
                                               eos_token="<|endoftext|>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(str(path))
    return path


def test_import_keeps_the_model_tokenizer_and_keys_and_export_ships_them_back(tmp_path, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)
    src = _hf_dir_with_tokenizer(tmp_path / "hf_src", 4096)
    assert hf.main(["import", "hf_src", "ckpt", "dataset_type=text", "learning_rate=1e-5"]) == 0
    recipe = yaml.safe_load((tmp_path / "ckpt" / "recipe.yml").read_text())
    assert recipe["tokenizer_path"] == str(src)  # the model's own tokenizer, as an absolute path
    assert (recipe["dataset_type"], recipe["learning_rate"]) == ("text", 1e-5)  # what the user passed
    assert recipe["load_parameters_path"] == str(tmp_path / "ckpt")
    assert hf.main(["export", "ckpt", "hf_back"]) == 0
    back = tmp_path / "hf_back"
    assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert json.loads((back / "config.json").read_text())["max_position_embeddings"] == 131072
    theirs = transformers.AutoTokenizer.from_pretrained(str(back))
    mine = transformers.AutoTokenizer.from_pretrained(str(src))
    chat = [{"role": "user", "content": "In the beginning"}]
    assert theirs.apply_chat_template(chat, tokenize=False) == "user: In the beginning\n"
    assert theirs.apply_chat_template(chat) == mine.apply_chat_template(chat)


def test_a_tokenizer_with_ids_the_model_cannot_embed_is_refused(tmp_path, capsys):
    _hf_dir_with_tokenizer(tmp_path / "small", 4000)  # model vocab 4000, tokenizer 4096 ids
    capsys.readouterr()  # transformers' own progress bar
    assert hf.main(["import", str(tmp_path / "small"), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 4096 ids but the model's vocab_size is 4000" in err[0]
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
    cfg = C.load(["base.yml", "model_name=tiny", "vocab_size=4000", "dataset_type=text"])
    with pytest.raises(ValueError, match="has 4096 ids but the model's vocab_size is 4000"):
        hf.export_hf(cfg, P.random_params(cfg), str(tmp_path / "out"))
    # a table padded past the tokenizer (Qwen2.5: 151,665 ids, 151,936 rows) is the model's own
    _hf_dir_with_tokenizer(tmp_path / "padded", 4160)
    assert hf.main(["import", str(tmp_path / "padded"), str(tmp_path / "ckpt2")]) == 0


def test_a_config_json_missing_a_key_is_one_line(tmp_path, capsys):
    config = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2,
              "intermediate_size": 64, "vocab_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf.main(["import", str(tmp_path), str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"maxlite: error: {tmp_path}/config.json: required key 'hidden_size' is missing"]
