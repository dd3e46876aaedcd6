"""Raw text formats, bad records, tokenizer formats and the tokenizer train CLI."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from maxlite import config as C
from maxlite.config import ConfigError
from maxlite.data import make_iterator, sources
from maxlite.data.tokenizer import BUNDLED_DIR, load_gpt2, load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = [{"text": f"Blessed are the {w}, for theirs is {i}.", "id": i}
           for i, w in enumerate(["meek", "poor", "pure", "merciful", "peacemakers"] * 3)]
TEXTS = [r["text"] for r in RECORDS]


def _write(path, fmt):
    import pyarrow as pa
    table = pa.Table.from_pylist(RECORDS)
    jsonl = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
    if fmt == "jsonl":
        path.write_bytes(jsonl)
    elif fmt == "json":
        path.write_text(json.dumps(RECORDS, indent=2))
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress(jsonl))
    elif fmt == "jsonl.zst":
        import zstandard
        path.write_bytes(zstandard.ZstdCompressor().compress(jsonl))
    elif fmt == "parquet":
        import pyarrow.parquet as pq
        pq.write_table(table, path, row_group_size=4)
    elif fmt == "arrow":
        with pa.ipc.new_file(str(path), table.schema) as w:
            w.write_table(table, max_chunksize=4)
    elif fmt == "arrow-stream":
        with pa.ipc.new_stream(str(path), table.schema) as w:
            w.write_table(table, max_chunksize=4)
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "arrow-stream"])
def test_every_format_streams_the_same_records(tmp_path, fmt):
    ext = "arrow" if fmt == "arrow-stream" else fmt
    path = _write(tmp_path / f"d.{ext}", fmt)
    bad = sources.BadRecords("error")
    docs = [t[0] for _, t in sources.iter_documents(path, ["text"], bad)]
    assert docs == TEXTS and bad.count == 0


def test_json_array_streams_in_small_chunks(tmp_path, monkeypatch):
    path = _write(tmp_path / "d.json", "json")
    monkeypatch.setattr(sources, "JSON_CHUNK", 7)  # records straddle many read boundaries
    docs = [t[0] for _, t in sources.iter_documents(path, ["text"], sources.BadRecords("error"))]
    assert docs == TEXTS
    lines = [n for n, _ in sources.iter_documents(path, ["text"], sources.BadRecords("error"))]
    assert lines[:2] == [2, 6]  # line numbers of the records' first lines


def test_directories_globs_and_commas(tmp_path):
    (tmp_path / "sub").mkdir()
    a = _write(tmp_path / "sub" / "a.jsonl", "jsonl")
    b = _write(tmp_path / "b.parquet", "parquet")
    (tmp_path / "sub" / "notes.md").write_text("ignored")
    assert sources.expand_paths(str(tmp_path / "sub")) == [a]
    assert sources.expand_paths(f"{tmp_path}/**/*.jsonl,{b}") == [a, b]
    for spec, msg in (("/nope.jsonl", "not found"), (f"{tmp_path}/*.zzz", "matches no file"),
                      ("", "empty"), (str(tmp_path / "empty_dir"), "not found"),
                      ("gs://b/x.jsonl", "remote text is not read directly")):
        with pytest.raises(ConfigError, match=msg):
            sources.expand_paths(spec)


def test_bad_records_counted_and_reported_as_file_line(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "good one"}\n{"text": 3}\n[1, 2]\n{oops\n\n{"body": "x"}\n{"text": "fine"}\n')
    bad = sources.BadRecords("skip")
    docs = [(n, t[0]) for n, t in sources.iter_documents(str(p), ["text"], bad)]
    assert docs == [(1, "good one"), (7, "fine")]
    assert bad.count == 4
    err = capsys.readouterr().err
    for line in (2, 3, 4, 6):
        assert f"{p}:{line}:" in err
    with pytest.raises(ConfigError, match=f"{p}:2: malformed record"):
        list(sources.iter_documents(str(p), ["text"], sources.BadRecords("error")))


@pytest.mark.parametrize("ext", ["gz", "zst"])
def test_truncated_compressed_file_is_reported(tmp_path, ext):
    import zstandard
    p = tmp_path / f"cut.jsonl.{ext}"
    raw = ("".join(json.dumps(r) + "\n" for r in RECORDS * 50)).encode()
    data = gzip.compress(raw) if ext == "gz" else b"".join(
        zstandard.ZstdCompressor().compress(raw[i:i + 2000]) for i in range(0, len(raw), 2000))
    p.write_bytes(data[: len(data) // 2])
    bad = sources.BadRecords("skip")
    docs = list(sources.iter_documents(str(p), ["text"], bad))
    assert 0 < len(docs) < len(RECORDS) * 50 and bad.count == 1
    assert "truncated" in bad.first[0]


def _cfg(*args):
    return C.resolve(C.load(["base.yml", "model_name=tiny", "dataset_type=text", *args]), 8)


def test_text_pipeline_bad_input(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no documents"):
        next(make_iterator(_cfg(f"dataset_path={empty}"), "train", 0, 1))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\nnot json\n')
    it = make_iterator(_cfg(f"dataset_path={broken}", "data_bad_record_policy=error"), "train", 0, 1)
    with pytest.raises(ConfigError, match=f"{broken}:2"):
        next(it)
    it.close()
    with pytest.raises(ConfigError, match="set eval_dataset_path"):
        make_iterator(_cfg(f"dataset_path={broken}"), "eval", 0, 1)


def test_json_keys_each_give_a_document(tmp_path):
    p = tmp_path / "qa.jsonl"
    p.write_text(json.dumps({"q": "Who?", "a": "Moses."}) + "\n")
    got = list(sources.iter_documents(str(p), ["q", "a"], sources.BadRecords("error")))
    assert got == [(1, ["Who?", "Moses."])]


def test_bundled_tokenizer_has_4096_ids_and_three_formats_agree():
    hf = load_tokenizer("")
    gpt2 = load_tokenizer(str(BUNDLED_DIR / "vocab.json"))
    gpt2b = load_gpt2(str(BUNDLED_DIR / "vocab.json"), str(BUNDLED_DIR / "merges.txt"))
    assert hf.vocab_size == gpt2.vocab_size == 4096 and hf.eos_id == gpt2.eos_id == 0
    for t in TEXTS[:4]:
        ids = hf.encode(t)
        assert ids.max() < 4096
        assert ids.tolist() == gpt2.encode(t).tolist() == gpt2b.encode(t).tolist()
        assert hf.decode(ids) == t
    import pickle
    assert pickle.loads(pickle.dumps(gpt2b)).encode(TEXTS[0]).tolist() == hf.encode(TEXTS[0]).tolist()


def test_sentencepiece_model(tmp_path):
    import sentencepiece as spm
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(TEXTS * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=40,
                                   minloglevel=2)
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    assert tok.vocab_size == 40 and tok.eos_id == 2 and tok.bos_id == 1
    assert tok.decode(tok.encode(TEXTS[0])) == TEXTS[0]


def test_unknown_tokenizer_formats(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\0")
    (tmp_path / "bad.json").write_text("{}")
    (tmp_path / "bad.model").write_bytes(b"nope")
    for path, msg in (("t.bin", "unknown tokenizer format"), ("bad.json", "cannot load"),
                      ("bad.model", "not a sentencepiece model"), (".", "no tokenizer.json")):
        with pytest.raises(ConfigError, match=msg):
            load_tokenizer(str(tmp_path / path))


def test_tokenizer_train_cli(tmp_path):
    corpus = _write(tmp_path / "c.jsonl", "jsonl")
    r = subprocess.run([sys.executable, "-m", "maxlite.data.tokenizer", "train", "--input", corpus,
                        "--vocab-size", "300", "--output", str(tmp_path / "tok"), "--min-frequency", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.vocab_size == 300 and tok.eos_id == 0
    assert (tmp_path / "tok" / "vocab.json").is_file() and (tmp_path / "tok" / "merges.txt").is_file()
    assert tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]
    ids = np.concatenate([tok.encode(t) for t in TEXTS])
    assert len(ids) < sum(len(t) for t in TEXTS) / 2  # it learned merges
