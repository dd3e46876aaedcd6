"""hf import / export stream through the checkpoint: bf16 round trips bit for bit, shards with an
index, gs:// through the emulator, host memory of a few tensors (not the model), one-line errors."""

import functools
import gc
import json
import pathlib
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from maxlite import checkpoints, config as C
from maxlite.bridge import hf
from maxlite.bridge import params as P
from maxlite.bridge.safetensors_io import INDEX_NAME, SafetensorsDir
from tests.gcs_emulator import gcs_emulator, make_bucket  # noqa: F401

BF16 = np.dtype(ml_dtypes.bfloat16)
# 8 layers, small vocabulary: the model is many times its largest tensor
MODEL = ["base.yml", "model_name=tiny", "dtype=bfloat16", "base_num_decoder_layers=8", "vocab_size=256"]


@functools.lru_cache(maxsize=None)
def _hf_model(root: str) -> tuple[pathlib.Path, int, int]:
    """A random model saved as bf16 safetensors in 3+ shards with an index; (dir, model bytes, largest)."""
    cfg = C.load(MODEL)
    out = pathlib.Path(root) / "hf"
    hf.export_hf(cfg, P.random_params(cfg), str(out), "bfloat16", max_shard_size="300KB", tokenizer="none")
    sizes = [int(np.prod(s)) * 2 for s in map(SafetensorsDir(out).shape, SafetensorsDir(out).names())]
    return out, sum(sizes), max(sizes)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return _hf_model(str(tmp_path_factory.mktemp("stream")))


def _bits_equal(a: pathlib.Path, b: pathlib.Path) -> None:
    x, y = SafetensorsDir(a), SafetensorsDir(b)
    assert sorted(x.names()) == sorted(y.names())
    for name in x.names():
        assert x.get(name).dtype == y.get(name).dtype == BF16, name
        assert np.array_equal(x.get(name).view(np.uint16), y.get(name).view(np.uint16)), name


def test_bf16_round_trip_is_bit_exact_and_export_shards_with_an_index(hf_model, tmp_path):
    src, _, _ = hf_model
    assert hf.main(["import", str(src), str(tmp_path / "ck")]) == 0
    cfg, params = checkpoints.load_params(str(tmp_path / "ck"))
    assert cfg.weight_dtype == "float32"  # stored as the recipe says (bf16 values exactly, in float32)
    assert all(v.dtype == np.float32 for _, v in P.leaves(P.to_pure(params)))
    # no --dtype: the dtype the model came in with; small shards: several files and an index
    assert hf.main(["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--max-shard-size", "250KB"]) == 0
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    out = SafetensorsDir(tmp_path / "out")
    held = {f: [n for n, g in index["weight_map"].items() if g == f] for f in files}
    assert len(files) > 2 and all(len(names) == 1 or sum(out.get(n).nbytes for n in names) <= 250_000
                                  for names in held.values())  # a tensor past the limit gets its own file
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _bits_equal(src, tmp_path / "out")
    # stored in bf16 (weight_dtype=bfloat16): the same bits through a half-size checkpoint
    assert hf.main(["import", str(src), str(tmp_path / "ck16"), "weight_dtype=bfloat16"]) == 0
    assert hf.main(["export", str(tmp_path / "ck16"), str(tmp_path / "out16")]) == 0
    assert (tmp_path / "out16" / "model.safetensors").is_file()  # 50GB shards: one file
    _bits_equal(src, tmp_path / "out16")


def _peak_numpy_bytes(fn) -> int:
    """Peak bytes Python and numpy hold at once while `fn` runs (tracemalloc traces numpy's buffers),
    under Python's default cycle collector (what a user's process runs; tests/conftest.py's is lazier)."""
    before = gc.get_threshold()
    gc.collect()
    gc.set_threshold(700, 10, 10)
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        gc.set_threshold(*before)


def test_import_and_export_hold_a_few_tensors_not_the_model(hf_model, tmp_path):
    """A conversion that held the model (the in-memory import, a list of pieces, a whole-leaf read)
    would trace at least the model's bytes (x2 in float32)."""
    src, model, largest = hf_model
    assert model > 12 * largest  # a conversion holding a few tensors holds far less than the model
    hf.main(["import", str(src), str(tmp_path / "warm")])  # first-use imports and caches out of the count
    imported = _peak_numpy_bytes(lambda: hf.main(["import", str(src), str(tmp_path / "ck")]))
    exported = _peak_numpy_bytes(lambda: hf.main(["export", str(tmp_path / "ck"), str(tmp_path / "out")]))
    whole = 2 * model  # the model in float32, what the checkpoint holds
    # what is traced beside the tensors (config, Orbax's metadata, JSON) is a few MiB at this size
    assert imported < whole / 2 and exported < whole / 2, (imported, exported, largest, whole)


def test_bad_input_is_one_line(hf_model, tmp_path, capsys):
    src, _, _ = hf_model
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    gone = sorted(f.name for f in src.glob("*.safetensors"))[1]
    for f in src.iterdir():
        if f.name != gone:
            (lacking / f.name).symlink_to(f)
    assert hf.main(["import", str(lacking), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"maxlite: error: {lacking}: {gone}, named by {INDEX_NAME}, is missing"]
    extra = tmp_path / "extra"
    hf.export_hf(C.load(MODEL), P.random_params(C.load(MODEL)), str(extra), "bfloat16", tokenizer="none")
    config = json.loads((extra / "config.json").read_text())
    (extra / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 7}))
    assert hf.main(["import", str(extra), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensors not mapped, e.g. model.layers.7." in err[0], err
    assert not (tmp_path / "b").exists() or not any((tmp_path / "b").iterdir())  # nothing written


@pytest.mark.gcs
def test_import_onto_gcs_and_export_from_it(hf_model, tmp_path, gcs_emulator):  # noqa: F811
    src, _, _ = hf_model
    bucket = make_bucket(gcs_emulator.url, "hf-stream")
    assert hf.main(["import", str(src), f"{bucket}/ck", "weight_dtype=bfloat16"]) == 0
    import gcsfs
    fs = gcsfs.GCSFileSystem()
    assert fs.exists(f"{bucket}/ck/0/commit_success.txt") and fs.exists(f"{bucket}/ck/recipe.yml")
    assert checkpoints.list_checkpoints(f"{bucket}/ck")[0]["complete"]
    assert hf.main(["export", f"{bucket}/ck", str(tmp_path / "out")]) == 0
    _bits_equal(src, tmp_path / "out")
