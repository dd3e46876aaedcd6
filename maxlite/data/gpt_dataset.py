"""dataset_type=indexed: Megatron-style GPT samples from memory-mapped `.bin/.idx`, blended.

A sample is `max_target_length + 1` consecutive tokens of the split's documents laid end to
end (samples overlap by one token, so every pair is trained once per epoch). Each epoch lays the
documents out in a new seeded order and visits the samples in a seeded permutation, without
materialising anything bigger than a cumulative-length array. Documents inside a sample get
their own segment id and positions; the target that crosses into the next document carries no
loss, so a packed row trains exactly like its documents run separately.
"""

from __future__ import annotations

import sys
import threading

import grain
import numpy as np

from maxlite.config import ConfigError
from maxlite.data.indexed import IndexedDataset

EPOCH_CACHE = 2  # layouts kept in memory: the current epoch and a straggling neighbour


def split_ranges(fractions: tuple[float, float, float], num_docs: int) -> list[tuple[int, int]]:
    """Megatron's `get_split_indices`: data_split's (train, valid, test) fractions (config's
    `split_fractions`) → [(0, a), (a, b), (b, num_docs)]."""
    idx = [0]
    for f in fractions:
        idx.append(idx[-1] + int(round(f * float(num_docs))))
    diff = idx[-1] - num_docs
    idx = [idx[0]] + [i - diff for i in idx[1:]]
    return list(zip(idx[:-1], idx[1:]))


class GPTSamples:
    """Random access to the samples of one prefix's document range, over endless epochs."""

    def __init__(self, ds: IndexedDataset, docs: tuple[int, int], seq_len: int, seed: int,
                 shuffle: bool, vocab_size: int):
        self.ds, self.seq_len, self.seed, self.shuffle = ds, seq_len, seed, shuffle
        self.vocab_size = vocab_size
        s0, s1 = int(ds.doc_idx[docs[0]]), int(ds.doc_idx[docs[1]])
        self.seq_ids = np.arange(s0, s1, dtype=np.int64)
        self.lengths = np.asarray(ds.lengths[s0:s1], np.int64)
        total = int(self.lengths.sum())
        self.per_epoch = (total - 1) // seq_len
        if self.per_epoch < 1:
            raise ConfigError(
                f"{ds.prefix}: documents {docs[0]}..{docs[1]} hold {total} tokens, fewer than one "
                f"sample of max_target_length+1={seq_len + 1}; use more data or a shorter sequence")
        self._layouts: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()  # grain reads samples from several threads

    def __getstate__(self):  # pickled into grain worker processes without the lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"} | {"_layouts": {}}

    def __setstate__(self, state):
        self.__dict__.update(state, _lock=threading.Lock())

    def _layout(self, epoch: int):
        with self._lock:
            return self._layout_locked(epoch)

    def _layout_locked(self, epoch: int):
        if epoch not in self._layouts:
            order = np.arange(len(self.seq_ids))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.seq_ids))
            lengths = self.lengths[order]
            ends = np.cumsum(lengths)
            if len(self._layouts) >= EPOCH_CACHE:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[epoch] = (self.seq_ids[order], lengths, ends)
        return self._layouts[epoch]

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        epoch, j = divmod(int(index), self.per_epoch)
        if self.shuffle:
            j = grain.experimental.index_shuffle(
                j, max_index=self.per_epoch - 1, seed=(self.seed * 1_000_003 + epoch) % (2**31), rounds=4)
        start, stop = j * self.seq_len, j * self.seq_len + self.seq_len + 1
        seq_ids, lengths, ends = self._layout(epoch)
        k = int(np.searchsorted(ends, start, side="right"))
        pieces, segs, pos = [], [], start
        while pos < stop:
            seq_start = int(ends[k] - lengths[k])
            a, b = pos - seq_start, min(int(lengths[k]), stop - seq_start)
            if b > a:
                sid = int(seq_ids[k])
                offset = int(self.ds.starts[sid])
                pieces.append(np.asarray(self.ds.tokens[offset + a:offset + b]))
                segs.append(b - a)
                pos += b - a
            k += 1
        tokens = np.concatenate(pieces).astype(np.int32)
        if tokens.max() >= self.vocab_size or tokens.min() < 0:
            bad = int(tokens.max() if tokens.max() >= self.vocab_size else tokens.min())
            raise ConfigError(f"{self.ds.prefix}: token id {bad} outside vocab_size={self.vocab_size}; "
                              f"the data was tokenized with another tokenizer or vocab_size is too small")
        seg = np.repeat(np.arange(1, len(segs) + 1, dtype=np.int32), segs)
        first = np.repeat(np.cumsum([0] + segs[:-1]), segs)
        positions = (np.arange(len(tokens)) - first).astype(np.int32)
        return {"inputs": tokens[:-1], "targets": tokens[1:], "positions": positions[:-1],
                "segment_ids": seg[:-1], "weights": (seg[1:] == seg[:-1]).astype(np.float32)}


def open_blend(blend: list[tuple[float, str]], stage) -> list[tuple[float, IndexedDataset]]:
    return [(w, IndexedDataset(stage(p))) for w, p in blend]


def make_indexed_dataset(config, split: str, process_index: int, process_count: int,
                         stage=lambda p: p) -> grain.MapDataset:
    """The blended, batched MapDataset whose element k is this process's share of step k."""
    train = split == "train"
    blend, eval_blend = config.blend("data_prefix"), config.blend("eval_data_prefix")  # parsed by config
    part = 0 if train else 1
    if not train and eval_blend:
        blend, part = eval_blend, None
    shuffle = train and config.data_shuffle
    sources = []
    for i, (w, ds) in enumerate(open_blend(blend, stage)):
        if ds.num_documents == 0:
            raise ConfigError(f"{ds.prefix}: the dataset is empty (0 documents)")
        docs = (0, ds.num_documents) if part is None else split_ranges(config.split_fractions, ds.num_documents)[part]
        if docs[1] <= docs[0]:
            raise ConfigError(
                f"{ds.prefix}: data_split={config.data_split} leaves no {split} documents "
                f"(of {ds.num_documents}); change data_split or set eval_data_prefix")
        samples = GPTSamples(ds, docs, config.max_target_length, config.data_shuffle_seed + 7 * i,
                             shuffle, config.vocab_size)
        sources.append((w, grain.MapDataset.source(samples)))
    if len(sources) == 1:
        ds = sources[0][1]
    else:
        ds = grain.MapDataset.mix([s for _, s in sources], [w for w, _ in sources])
    n = config.global_batch_size // process_count
    # Batch k of n samples is rows [p*n, (p+1)*n) of global step k // P when p = k % P.
    return ds.batch(n)[process_index::process_count]
