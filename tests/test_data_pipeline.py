"""make_iterator: batch contract, blends, packing, multi-process shares, exact resume."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from maxlite import config as C
from maxlite.config import ConfigError
from maxlite.data import indexed, make_iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"inputs": np.int32, "targets": np.int32, "positions": np.int32,
        "segment_ids": np.int32, "weights": np.float32}


def _cfg(*args, devices=8):
    return C.resolve(C.load(["base.yml", "model_name=tiny", *args]), devices)


def _prefix(path, docs):
    with indexed.IndexedWriter(str(path), np.uint16) as w:
        for d in docs:
            w.add_document(d)
    return str(path)


@pytest.fixture(scope="module")
def two_prefixes(tmp_path_factory):
    """Dataset A holds ids 1..999, B ids 1000..1999; docs end with EOD id 0."""
    d = tmp_path_factory.mktemp("idx")
    rng = np.random.default_rng(0)
    make = lambda lo: [np.append(rng.integers(lo, lo + 999, rng.integers(3, 60)), 0) for _ in range(300)]
    return _prefix(d / "a", make(1)), _prefix(d / "b", make(1000))


def _check_contract(batch, rows, seq):
    assert set(batch) == set(KEYS)
    for k, dt in KEYS.items():
        assert batch[k].shape == (rows, seq) and batch[k].dtype == dt, k


def _check_segments(b):
    """Positions restart per segment, segments count up from 1, padding has id 0 and no loss."""
    for r in range(b["inputs"].shape[0]):
        seg, pos = b["segment_ids"][r], b["positions"][r]
        real = seg > 0
        assert np.all(np.diff(seg[real]) >= 0) and seg[real][0] == 1
        assert np.all(b["weights"][r][~real] == 0)
        for s in np.unique(seg[real]):
            np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))


def test_indexed_contract_and_doc_boundaries(two_prefixes):
    c = _cfg("dataset_type=indexed", f"data_prefix={two_prefixes[0]}", "max_target_length=32")
    it = make_iterator(c, "train", 0, 1)
    for _ in range(3):
        b = next(it)
        _check_contract(b, 16, 32)
        _check_segments(b)
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        # A target crossing into the next document carries no loss; the EOD (0) ends each doc.
        cross = b["segment_ids"][:, 1:] != b["segment_ids"][:, :-1]
        assert np.all(b["weights"][:, :-1][cross] == 0)
        assert np.all(b["inputs"][:, :-1][cross] == 0)
    json.dumps(it.get_state())
    it.close()


def test_blend_proportions_within_one_percent(two_prefixes):
    a, b = two_prefixes
    c = _cfg("dataset_type=indexed", f"data_prefix=[0.3,{a},0.7,{b}]", "max_target_length=8",
             "per_device_batch_size=125")
    it = make_iterator(c, "train", 0, 1)
    # A row of A holds only ids < 1000 (EOD is 0 in both); B rows always hold some id >= 1000.
    from_a = sum(int((next(it)["inputs"].max(axis=1) < 1000).sum()) for _ in range(10))
    it.close()
    assert abs(from_a / 10_000 - 0.3) < 0.01


def test_train_eval_split_disjoint(two_prefixes):
    c = _cfg("dataset_type=indexed", f"data_prefix={two_prefixes[0]}", "data_split=50,50,0",
             "max_target_length=16", "data_shuffle=false")
    ds = indexed.IndexedDataset(two_prefixes[0])
    half = {tuple(ds[i].tolist()) for i in range(150)}
    ev = make_iterator(c, "eval", 0, 1)
    b = next(ev)
    ev.close()
    # The first eval sample starts at document 150.
    np.testing.assert_array_equal(b["inputs"][0][:len(ds[150])], ds[150][:16])
    assert tuple(ds[150].tolist()) not in half


@pytest.mark.parametrize("kind", ["indexed", "text"])
def test_two_processes_cover_the_global_batch_exactly(two_prefixes, kind):
    args = ["max_target_length=32", f"dataset_type={kind}"]
    if kind == "indexed":
        args.append(f"data_prefix=[1,{two_prefixes[0]},1,{two_prefixes[1]}]")
    c = _cfg(*args)
    its = [make_iterator(c, "train", p, n) for p, n in ((0, 1), (0, 2), (1, 2))]
    for _ in range(3):
        whole, p0, p1 = (next(i) for i in its)
        for k in KEYS:
            np.testing.assert_array_equal(whole[k], np.concatenate([p0[k], p1[k]]))
    for i in its:
        i.close()


RESUME = textwrap.dedent("""
    import json, sys, numpy as np
    from maxlite import config as C
    from maxlite.data import make_iterator
    args, mode, path = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    c = C.resolve(C.load(["base.yml", "model_name=tiny", *args]), 8)
    it = make_iterator(c, "train", 0, 1)
    if mode == "first":
        for _ in range(5):
            next(it)
        json.dump(it.get_state(), open(path + ".json", "w"))
    else:
        it.set_state(json.load(open(path + ".json")))
    np.savez(path + f"_{mode}.npz", *[next(it)["inputs"] for _ in range(4)])
    it.close()
""")


@pytest.mark.parametrize("kind", ["indexed", "text"])
def test_resume_in_a_new_process_is_exact(tmp_path, two_prefixes, kind):
    args = ["max_target_length=32", f"dataset_type={kind}"]
    if kind == "indexed":
        args.append(f"data_prefix=[1,{two_prefixes[0]},1,{two_prefixes[1]}]")
    else:  # keys only the text pipeline reads (the indexed source refuses them)
        args += ["packing_bins=4", "data_shuffle_window=64"]
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    base = str(tmp_path / "run")
    for mode in ("first", "restored"):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        r = subprocess.run([sys.executable, str(script), json.dumps(args), mode, base], cwd=ROOT,
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
    first, restored = np.load(base + "_first.npz"), np.load(base + "_restored.npz")
    for k in first.files:
        np.testing.assert_array_equal(first[k], restored[k])
    # And the restored batches are the ones an uninterrupted run reads as batches 6..9.
    it = make_iterator(_cfg(*args), "train", 0, 1)
    for _ in range(5):
        next(it)
    for k in first.files:
        np.testing.assert_array_equal(next(it)["inputs"], first[k])
    it.close()


SOURCES = {"synthetic": ["base.yml", "model_name=tiny", "dataset_type=synthetic", "max_target_length=32"],
           "text": ["base.yml", "model_name=tiny", "dataset_type=text", "max_target_length=32"],
           "sft": ["sft.yml", "max_target_length=64"],
           "preference": ["dpo.yml", "max_target_length=64"]}


@pytest.mark.parametrize("source", [*SOURCES, "indexed"])
def test_a_data_position_resumes_on_any_number_of_processes(two_prefixes, source):
    """After 3 steps read by one process, or by two, the position is the same, and two processes
    (or one) restored from it read exactly the global batches one uninterrupted process reads next."""
    args = SOURCES.get(source) or ["base.yml", "model_name=tiny", "dataset_type=indexed", "max_target_length=32",
                                   f"data_prefix=[1,{two_prefixes[0]},1,{two_prefixes[1]}]"]
    c = C.resolve(C.load([*args, "per_device_batch_size=1"]), 4)
    one, two = make_iterator(c, "train", 0, 1), [make_iterator(c, "train", p, 2) for p in (0, 1)]
    for _ in range(3):
        for it in (one, *two):
            next(it)
    position = one.get_state()
    assert all(json.dumps(it.get_state(), sort_keys=True) == json.dumps(position, sort_keys=True) for it in two)
    restored_two = [make_iterator(c, "train", p, 2) for p in (0, 1)]
    restored_one = make_iterator(c, "train", 0, 1)
    for it in (*restored_two, restored_one):
        it.set_state(position)
    for _ in range(2):
        whole = next(one)
        halves = [next(it) for it in restored_two]
        again = next(restored_one)
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), whole[k], err_msg=k)
            np.testing.assert_array_equal(again[k], whole[k], err_msg=k)
    for it in (one, *two, *restored_two, restored_one):
        it.close()


def test_resume_rejects_other_settings(two_prefixes):
    c = _cfg("dataset_type=indexed", f"data_prefix={two_prefixes[0]}", "max_target_length=32")
    it = make_iterator(c, "train", 0, 1)
    state = it.get_state()
    it.close()
    it = make_iterator(_cfg("dataset_type=indexed", f"data_prefix={two_prefixes[0]}",
                            "max_target_length=16"), "train", 0, 1)
    with pytest.raises(ConfigError, match="max_target_length=32"):
        it.set_state(state)
    it.close()


def test_text_packing_keeps_documents_whole(tmp_path):
    from maxlite.data.tokenizer import load_tokenizer
    tok = load_tokenizer("")
    texts = [f"And it came to pass, on day {i}, that " + "the word went forth. " * (i % 7) for i in range(60)]
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    c = _cfg("dataset_type=text", f"dataset_path={src}", "max_target_length=24", "data_shuffle=false")
    it = make_iterator(c, "train", 0, 1)
    pairs = []
    for _ in range(6):
        b = next(it)
        _check_contract(b, 16, 24)
        _check_segments(b)
        for r in range(16):
            for s in np.unique(b["segment_ids"][r][b["segment_ids"][r] > 0]):
                m = b["segment_ids"][r] == s
                assert np.all(b["weights"][r][m] == 1)
                pairs.append((b["inputs"][r][m], b["targets"][r][m]))
    it.close()
    # Every document (+EOD) is cut into pieces of ≤ 25 tokens overlapping by one; each piece
    # appears whole, inside one segment, in the packed rows.
    packed = {tuple(np.append(x, y[-1]).tolist()) for x, y in pairs}
    for t in texts[:20]:
        doc = np.append(tok.encode(t), tok.eos_id).tolist()
        for start in range(0, len(doc) - 1, 24):
            assert tuple(doc[start:start + 25]) in packed


def test_token_ids_beyond_vocab_are_an_error(tmp_path):
    p = _prefix(tmp_path / "big", [np.arange(4000, 4200)] * 3)
    c = _cfg("dataset_type=indexed", f"data_prefix={p}", "max_target_length=16")
    it = make_iterator(c, "train", 0, 1)
    with pytest.raises(ConfigError, match="outside vocab_size=4096"):
        next(it)
    it.close()


@pytest.mark.parametrize("args, message", [
    (["dataset_type=indexed"], "needs data_prefix"),
    (["dataset_type=indexed", "data_prefix=/nonexistent/x"], "not found"),
    (["dataset_type=indexed", "data_prefix=[1,a,b]"], "weight,prefix pairs"),
    (["dataset_type=text", "dataset_path=/nonexistent/*.jsonl"], "matches no file"),
    (["dataset_type=text", "tokenizer_path=/nonexistent"], "not found"),
    (["dataset_type=text", "model_name=tiny", "vocab_size=1000"], "has 4096 ids but vocab_size=1000"),
    (["dataset_type=text", "eos_id=5000"], "eos_id=5000 is outside vocab_size=4096"),
    (["dataset_type=text", "data_bad_record_policy=drop"], "choose one of skip, error"),
    (["dataset_type=indexed", "data_prefix=x", "data_split=a,b"], "expected three numbers"),
])
def test_config_mistakes(args, message):
    with pytest.raises(ConfigError, match=message):
        it = make_iterator(_cfg(*args), "train", 0, 1)
        next(it)


def test_grain_worker_processes_give_the_same_batches_and_resume(two_prefixes):
    args = ["dataset_type=indexed", f"data_prefix=[1,{two_prefixes[0]},1,{two_prefixes[1]}]",
            "max_target_length=32"]
    ref = make_iterator(_cfg(*args), "train", 0, 1)
    it = make_iterator(_cfg(*args, "grain_worker_count=1"), "train", 0, 1)
    for _ in range(3):
        np.testing.assert_array_equal(next(it)["inputs"], next(ref)["inputs"])
    state = json.loads(json.dumps(it.get_state()))
    want = next(it)
    it.close()
    again = make_iterator(_cfg(*args, "grain_worker_count=1"), "train", 0, 1)
    again.set_state(state)
    got = next(again)
    for k in KEYS:
        np.testing.assert_array_equal(got[k], want[k])
        assert type(got[k]) is np.ndarray  # a plain copy, not a shared-memory view
    np.testing.assert_array_equal(next(ref)["inputs"], want["inputs"])
    again.close()
    ref.close()
