"""DeepSeek-V2 (no query latent, softmax routing in groups) and DeepSeek-V3 (query latent, sigmoid
routing with the expert bias, in groups), both with YaRN RoPE and its softmax factor, built small
and random by transformers (tests/hf_models.py), with a word tokenizer and chat template of
their own: import → float32 logits equal transformers' (relative error ≤ 1e-5), greedy decoding
through the latent cache equals `generate`, export → transformers loads the same architecture and
computes the same logits, the tokenizer and template come back unchanged."""

import dataclasses
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.bridge.safetensors_io import Entry, SafetensorsDir, write_sharded
from tests import hf_models
from tests.helpers import greedy_paths, jax_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, T = 256, 12
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"


def _word_tokenizer(directory):
    import tokenizers

    vocab = {f"w{i}": i for i in range(V - 1)} | {"<eos>": V - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(directory))


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def imported(request, tmp_path_factory):
    """(the HF model, its directory, the imported config and params)."""
    path = tmp_path_factory.mktemp(request.param)
    model = hf_models.model(request.param)
    model.save_pretrained(str(path / "hf"))
    _word_tokenizer(path / "hf")
    cfg, pure = hf.import_hf(str(path / "hf"), ["max_target_length=32"])
    yield model, path, cfg, pure
    jax.clear_caches()


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_import_gives_transformers_logits_and_greedy_path(imported):
    model, _, cfg, pure = imported
    assert cfg.attention_type == "mla" and cfg.decoder_block == "deepseek"
    ids = np.random.default_rng(1).integers(0, V - 1, (2, T))
    assert _relative(jax_logits(cfg, pure, ids), _logits(model, ids)) <= 1e-5

    ours, theirs = greedy_paths(cfg, pure, model, list(range(10, 18)))
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)


def test_export_loads_in_transformers_with_the_same_logits_and_tokenizer(imported):
    model, path, cfg, pure = imported
    hf.export_hf(cfg, pure, str(path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    ids = np.random.default_rng(2).integers(0, V - 1, (2, T))
    assert _relative(_logits(back, ids), _logits(model, ids)) <= 1e-5
    assert (path / "back" / "tokenizer.json").read_bytes() == (path / "hf" / "tokenizer.json").read_bytes()
    shipped = [f for f in hf.TOKENIZER_FILES if (path / "hf" / f).is_file()]
    assert any(TEMPLATE in (path / "hf" / f).read_text() for f in shipped)  # the template is among them
    for name in shipped:
        assert (path / "back" / name).read_bytes() == (path / "hf" / name).read_bytes(), name


def _copy_beside(src, dst):
    """config.json and the tokenizer files of one HF directory in another."""
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith((".safetensors", ".json")) or f.name.endswith("config.json") or "token" in f.name:
            if not f.name.endswith(".safetensors"):
                shutil.copy(f, dst / f.name)


def test_fp8_block_scaled_weights_are_dequantized_on_import(imported, tmp_path):
    """DeepSeek's published FP8 layout: every projection float8_e4m3 with one float32 scale per
    128 × 128 block (the output head too here: 256 rows, two blocks) imports as the float
    checkpoint holding fp8 × scale."""
    _, path, cfg, _ = imported
    source = SafetensorsDir(path / "hf")
    fp8, plain = {}, {}
    for name in source.names():
        w = np.asarray(source.get(name), np.float32)
        if w.ndim == 2 and ("proj" in name or name == "lm_head.weight"):
            rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
            padded = np.zeros((rows * 128, cols * 128), np.float32)
            padded[:w.shape[0], :w.shape[1]] = np.abs(w)
            scale = padded.reshape(rows, 128, cols, 128).max(axis=(1, 3)) / 448 + 1e-12
            expanded = np.kron(scale, np.ones((128, 128), np.float32))[:w.shape[0], :w.shape[1]]
            q = (w / expanded).astype(ml_dtypes.float8_e4m3fn)
            fp8[name], fp8[name + "_scale_inv"] = q, scale.astype(np.float32)
            plain[name] = q.astype(np.float32) * expanded
        else:
            fp8[name] = plain[name] = w
    for directory, tensors in (("fp8", fp8), ("plain", plain)):
        _copy_beside(path / "hf", tmp_path / directory)
        write_sharded(tmp_path / directory, [Entry(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()],
                      1 << 40, {})
    _, from_fp8 = hf.import_hf(str(tmp_path / "fp8"), ["max_target_length=32"])
    _, from_plain = hf.import_hf(str(tmp_path / "plain"), ["max_target_length=32"])
    fp8_leaves, plain_leaves, float_leaves = (dict(P.leaves(t)) for t in (from_fp8, from_plain, imported[3]))
    assert fp8_leaves.keys() == plain_leaves.keys()
    for key, a in fp8_leaves.items():
        np.testing.assert_array_equal(a, plain_leaves[key], err_msg=str(key))
    assert any(not np.array_equal(a, float_leaves[key]) for key, a in fp8_leaves.items())  # fp8 rounded them


def test_mtp_depths_export_where_deepseek_stores_them_and_import_back(imported):
    """A model with a multi-token-prediction depth exports it as layer num_hidden_layers (transformers
    loads the rest and computes the same logits) and imports it back unchanged."""
    model, path, cfg, pure = imported
    if cfg.routed_score_func != "sigmoid":
        pytest.skip("DeepSeek-V2 checkpoints have no multi-token prediction")
    with_mtp = dataclasses.replace(cfg, mtp_num_layers=1)
    params = P.random_params(with_mtp, seed=3)
    params.update({k: v for k, v in pure.items()})
    hf.export_hf(with_mtp, params, str(path / "mtp"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(path / "mtp"), dtype=torch.float32)
    ids = np.random.default_rng(3).integers(0, V - 1, (2, T))
    assert _relative(_logits(back, ids), _logits(model, ids)) <= 1e-5
    again_cfg, again = hf.import_hf(str(path / "mtp"), ["max_target_length=32"])
    assert again_cfg.mtp_num_layers == 1
    ours, theirs = dict(P.leaves(params["mtp"])), dict(P.leaves(again["mtp"]))
    assert ours.keys() == theirs.keys()
    for key, a in ours.items():
        np.testing.assert_array_equal(theirs[key], a, err_msg=str(key))
