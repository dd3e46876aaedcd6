"""Byte-identical with Megatron-core's own writer, reader and merge (runs where megatron-core imports).

Checked by hand with megatron-core 0.16.1 (CPU torch): .idx, .bin and merged files identical.
"""

import filecmp

import numpy as np
import pytest

from maxlite.data import indexed

megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
torch = pytest.importorskip("torch")


def test_files_identical_to_megatron_core(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 4096, rng.integers(1, 100)) for _ in range(200)]
    b = megatron.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=np.uint16)
    for d in docs:
        b.add_document(torch.tensor(d), [len(d)])
    b.finalize(str(tmp_path / "meg.idx"))
    with indexed.IndexedWriter(str(tmp_path / "mine"), np.uint16) as w:
        for d in docs:
            w.add_document(d)
    for ext in (".idx", ".bin"):
        assert filecmp.cmp(tmp_path / f"meg{ext}", tmp_path / f"mine{ext}", shallow=False)
    theirs = megatron.IndexedDataset(str(tmp_path / "mine"))
    ours = indexed.IndexedDataset(str(tmp_path / "meg"))
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
        np.testing.assert_array_equal(ours[i], d)
    b = megatron.IndexedDatasetBuilder(str(tmp_path / "mm.bin"), dtype=np.uint16)
    b.add_index(str(tmp_path / "meg"))
    b.add_index(str(tmp_path / "mine"))
    b.finalize(str(tmp_path / "mm.idx"))
    indexed.merge([str(tmp_path / "meg"), str(tmp_path / "mine")], str(tmp_path / "om"))
    for ext in (".idx", ".bin"):
        assert filecmp.cmp(tmp_path / f"mm{ext}", tmp_path / f"om{ext}", shallow=False)
