"""Byte-identical with Megatron-core's own writer, reader and merge (megatron-core 0.16.1, pinned in
the `test` extra, on CPU torch): .idx, .bin and merged files identical.
"""

import filecmp

import megatron.core.datasets.indexed_dataset as megatron
import numpy as np
import torch

from maxlite.data import indexed


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
