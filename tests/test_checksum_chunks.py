"""Checksums hashed off the GIL (ISA-L's CRC32C, or libcrc32c's) and in pieces across threads
record and check exactly what one CRC32C pass over each shard would (google_crc32c is the reference)."""

from __future__ import annotations

import sys

import google_crc32c
import numpy as np

from maxlite.checkpoints import checksums, crc


def _agrees_with_google_crc32c():
    a = np.random.default_rng(0).standard_normal((7, 33)).astype(np.float32)
    for data in (a, a[:, 3:], a.T, np.zeros((0, 4), np.float32)):
        assert crc.value(data) == google_crc32c.value(np.ascontiguousarray(data).tobytes())
    for data in (b"", b"abc", a.tobytes()):
        assert crc.value(data) == google_crc32c.value(data)


def test_the_crc_is_isa_l_off_the_gil_and_is_google_crc32c(monkeypatch):
    assert crc.implementation() == "isa-l"  # through ctypes: hashing does not stall Orbax's Python threads
    assert crc.releases_gil()
    _agrees_with_google_crc32c()
    monkeypatch.setattr(crc, "_MAX_CALL", 100)  # ISA-L's C-int length: long buffers go in calls of _MAX_CALL
    _agrees_with_google_crc32c()


def test_without_isa_l_the_crc_is_libcrc32c_off_the_gil(monkeypatch):
    monkeypatch.setitem(sys.modules, "isal", None)  # as where python-isal has no wheel
    crc._native.cache_clear()
    try:
        assert crc.implementation() == "libcrc32c" and crc.releases_gil()
        _agrees_with_google_crc32c()
    finally:
        crc._native.cache_clear()


def test_a_shard_hashed_in_chunks_records_and_checks_its_crc(monkeypatch):
    monkeypatch.setattr(checksums, "CHUNK", 100)  # 572 bytes: five whole chunks and a short one
    a = np.random.default_rng(1).standard_normal((13, 11)).astype(np.float32)
    empty = np.zeros((0, 4), np.float32)
    record = checksums.record({"params": {"w": a, "e": empty}}, {}, 0, 1).result()
    assert record["arrays"]["params/w"]["shards"] == [[[[0, 13], [0, 11]], google_crc32c.value(a.tobytes())]]
    assert record["arrays"]["params/e"]["shards"] == [[[[0, 0], [0, 4]], google_crc32c.value(b"")]]
    records = checksums.Records({name: {**r, "shards": [(tuple(map(tuple, box)), c) for box, c in r["shards"]]}
                                 for name, r in record["arrays"].items()}, {})

    def damaged(w):
        got, unknown = checksums.pieces(records, {"w": w, "e": empty}, "params").result()
        assert unknown == []
        return checksums.damaged(records, [got])
    assert damaged(a) == []
    for at in (0, 301, 571):  # the first chunk, a middle one, the short last one
        b = a.copy()
        b.reshape(-1).view(np.uint8)[at] ^= 1
        assert damaged(b) == ["params/w"], at
