"""Megatron .bin/.idx: byte format, writer/reader, merge, preprocess CLI, bad files."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from maxlite.config import ConfigError
from maxlite.data import indexed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docs(n=50, seed=0, high=4000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, rng.integers(1, 40)) for _ in range(n)]


def _write(prefix, docs, dtype=np.uint16):
    with indexed.IndexedWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def test_round_trip(tmp_path):
    docs = _docs()
    ds = indexed.IndexedDataset(_write(tmp_path / "a", docs))
    assert ds.num_documents == len(docs) == ds.num_sequences
    assert ds.dtype == np.uint16
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        np.testing.assert_array_equal(ds.document(i)[0], d)
    assert list(ds.doc_idx) == list(range(len(docs) + 1))


def test_int32_when_vocab_large(tmp_path):
    assert indexed.best_dtype(65499) == np.uint16 and indexed.best_dtype(65500) == np.int32
    docs = _docs(high=200_000)
    ds = indexed.IndexedDataset(_write(tmp_path / "b", docs, np.int32))
    assert ds.dtype == np.int32
    np.testing.assert_array_equal(ds[3], docs[3])


def test_reads_bytes_built_by_hand_from_the_spec(tmp_path):
    # Two documents: doc 0 = two sequences [5, 6, 7] and [8]; doc 1 = one sequence [9, 65535].
    seqs = [[5, 6, 7], [8], [9, 65535]]
    lengths = [3, 1, 2]
    pointers = [0, 6, 8]  # byte offsets of uint16 tokens
    doc_idx = [0, 2, 3]
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
           + struct.pack("<Q", 3) + struct.pack("<Q", 3)
           + struct.pack("<3i", *lengths) + struct.pack("<3q", *pointers) + struct.pack("<3q", *doc_idx))
    (tmp_path / "h.idx").write_bytes(idx)
    (tmp_path / "h.bin").write_bytes(struct.pack("<6H", 5, 6, 7, 8, 9, 65535))
    ds = indexed.IndexedDataset(str(tmp_path / "h"))
    assert ds.num_sequences == 3 and ds.num_documents == 2
    assert [ds[i].tolist() for i in range(3)] == seqs
    assert [s.tolist() for s in ds.document(0)] == [[5, 6, 7], [8]]
    # And the writer produces exactly these bytes.
    with indexed.IndexedWriter(str(tmp_path / "w"), np.uint16) as w:
        w.add_sequences([[5, 6, 7], [8]])
        w.add_document([9, 65535])
    assert (tmp_path / "w.idx").read_bytes() == idx
    assert (tmp_path / "w.bin").read_bytes() == (tmp_path / "h.bin").read_bytes()


def test_merge(tmp_path):
    a, b = _docs(10, 1), _docs(7, 2)
    merged = indexed.merge([_write(tmp_path / "a", a), _write(tmp_path / "b", b)], str(tmp_path / "m"))
    assert merged.num_documents == 17
    for i, d in enumerate(a + b):
        np.testing.assert_array_equal(merged[i], d)


@pytest.mark.parametrize("damage, message", [
    ("no_bin", "not found"),
    ("short_bin", "does not match its index"),
    ("long_bin", "does not match its index"),
    ("short_idx", "truncated"),
    ("bad_magic", "not a Megatron MMIDIDX"),
])
def test_bad_files_are_one_clear_error(tmp_path, damage, message):
    p = _write(tmp_path / "x", _docs())
    binf, idxf = p + ".bin", p + ".idx"
    if damage == "no_bin":
        os.remove(binf)
    elif damage == "short_bin":
        os.truncate(binf, os.path.getsize(binf) - 2)
    elif damage == "long_bin":
        with open(binf, "ab") as f:
            f.write(b"\0\0")
    elif damage == "short_idx":
        os.truncate(idxf, os.path.getsize(idxf) - 8)
    else:
        data = bytearray(open(idxf, "rb").read())
        data[0:3] = b"XYZ"
        open(idxf, "wb").write(bytes(data))
    with pytest.raises(ConfigError, match=message):
        indexed.IndexedDataset(p)


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "maxlite.data.preprocess", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=120)


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


TEXTS = [f"In the beginning {i} was the word, and the word was {i * i}." for i in range(40)]


def test_preprocess_cli_matches_tokenizer_and_merges(tmp_path):
    from maxlite.data.tokenizer import load_tokenizer
    src = _jsonl(tmp_path / "in.jsonl", TEXTS)
    r = _run("--input", src, "--output-prefix", str(tmp_path / "out"), "--append-eod", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "docs/s" in r.stderr and "MB/s" in r.stderr
    tok = load_tokenizer("")
    ds = indexed.IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.dtype == np.uint16 and ds.num_documents == len(TEXTS)
    for i, t in enumerate(TEXTS):
        assert ds[i].tolist() == tok.encode(t).tolist() + [tok.eos_id]
    # Two ranks with a shared file split records; merge restores every document once.
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2")
        r = _run("--input", src, "--output-prefix", str(tmp_path / "sh"), "--append-eod", env=env)
        assert r.returncode == 0, r.stderr
    r = _run("merge", "--inputs", str(tmp_path / "sh_part*_text_document"),
             "--output-prefix", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    merged = indexed.IndexedDataset(str(tmp_path / "merged"))
    got = sorted(tuple(merged[i].tolist()) for i in range(merged.num_sequences))
    assert got == sorted(tuple(ds[i].tolist()) for i in range(ds.num_sequences))


def test_preprocess_bad_input_exit_2(tmp_path):
    r = _run("--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.startswith("maxlite: error:") and "not found" in r.stderr
    assert "Traceback" not in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = _run("--input", str(empty), "--output-prefix", str(tmp_path / "o"))
    assert r.returncode == 2 and "no documents" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n{"txt": "wrong key"}\n')
    r = _run("--input", str(bad), "--output-prefix", str(tmp_path / "o"), "--bad-record-policy", "error")
    assert r.returncode == 2 and f"{bad}:2" in r.stderr
    r = _run("--input", str(bad), "--output-prefix", str(tmp_path / "o"))
    assert r.returncode == 0 and f"{bad}:2" in r.stderr and f"{bad}:3" in r.stderr
    assert "2 malformed record(s) skipped" in r.stderr
    weird = tmp_path / "tok.xyz"
    weird.write_text("?")
    r = _run("--input", str(bad), "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(weird))
    assert r.returncode == 2 and "unknown tokenizer format" in r.stderr
