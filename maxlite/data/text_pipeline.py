"""dataset_type=text: raw files streamed → shuffled in a window → tokenized → packed → batched.

Documents longer than a row are cut into pieces of `max_target_length + 1` tokens that overlap
by one token, so every (input, target) pair of the document is trained exactly once. Packing
is grain's first-fit: each row holds whole pieces, with segment ids and positions, and the
padding carries no loss. Every process runs the same stream and keeps its rows of the global
batch, so P processes reproduce exactly what one process reads (text is for small corpora and
demos; for large data run `python -m maxlite.data.preprocess` and use dataset_type=indexed).
"""

from __future__ import annotations

from typing import Any, Sequence

import grain
import numpy as np

from maxlite.config import ConfigError
from maxlite.data import sources
from maxlite.data.tokenizer import BUNDLED_DIR, Tokenizer

BUNDLED_TRAIN = str(BUNDLED_DIR / "kjv_train.jsonl.zst")
BUNDLED_EVAL = str(BUNDLED_DIR / "kjv_eval.jsonl.zst")


class _RecordIterator(grain.DatasetIterator):
    """Well-formed records of `files`, epoch after epoch. State: (epoch, file, record)."""

    def __init__(self, files: Sequence[str], keys: Sequence[str], bad: sources.BadRecords,
                 seed: int, shuffle: bool, loop: bool, parse=None):
        super().__init__()
        self._files, self._keys, self._bad, self._parse = list(files), list(keys), bad, parse
        self._seed, self._shuffle, self._loop = seed, shuffle, loop
        self._epoch = self._file = self._record = 0
        self._gen = None
        self._docs_this_epoch = 0

    def _path(self) -> str:
        order = np.arange(len(self._files))
        if self._shuffle:
            order = np.random.default_rng([self._seed, self._epoch]).permutation(len(self._files))
        return self._files[order[self._file]]

    def _open(self) -> None:
        self._gen = sources.iter_documents(self._path(), self._keys, self._bad, self._parse)
        # A restore skips records already read: bad ones among them were counted before.
        self._bad.silent = True
        try:
            for _ in range(self._record):
                next(self._gen)
        except StopIteration:
            raise ConfigError(f"{self._path()} has fewer records than the saved data state "
                              f"says ({self._record}): the data changed since the checkpoint") from None
        finally:
            self._bad.silent = False

    def __next__(self) -> dict[str, Any]:
        while True:
            if self._gen is None:
                self._open()
            try:
                number, texts = next(self._gen)
            except StopIteration:
                self._gen, self._record = None, 0
                self._file += 1
                if self._file < len(self._files):
                    continue
                if self._docs_this_epoch == 0:
                    raise ConfigError(
                        f"no documents in {', '.join(self._files[:3])}"
                        f"{' ...' if len(self._files) > 3 else ''} ({self._bad.summary()})") from None
                if not self._loop:
                    raise
                self._epoch, self._file, self._docs_this_epoch = self._epoch + 1, 0, 0
                continue
            self._record += 1
            self._docs_this_epoch += 1
            return {"texts": texts, "path": self._path(), "record": number}

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "file": self._file, "record": self._record}

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch, self._file, self._record = state["epoch"], state["file"], state["record"]
        self._gen = None
        self._docs_this_epoch = 1 if (self._file or self._record) else 0


class _Records(grain.IterDataset):
    def __init__(self, *args):
        super().__init__()
        self._args = args

    def __iter__(self) -> _RecordIterator:
        return _RecordIterator(*self._args)


class _TokenizeAndCut(grain.experimental.FlatMapTransform):
    """Texts → token ids (+BOS/EOS) → pieces of ≤ seq+1 tokens overlapping by one."""

    max_fan_out = 1 << 20

    def __init__(self, tok: Tokenizer, seq_len: int, add_bos: bool, add_eos: bool):
        self.tok, self.seq_len, self.add_bos, self.add_eos = tok, seq_len, add_bos, add_eos

    def flat_map(self, element: dict[str, Any]) -> list[dict[str, np.ndarray]]:
        out = []
        for ids in self.tok.encode_batch(element["texts"]):
            parts = ([[self.tok.bos_id]] if self.add_bos else []) + [ids] + (
                [[self.tok.eos_id]] if self.add_eos else [])
            doc = np.concatenate([np.asarray(p, np.int32) for p in parts])
            for start in range(0, max(len(doc) - 1, 0), self.seq_len):
                piece = doc[start:start + self.seq_len + 1]
                out.append({"inputs": piece[:-1], "targets": piece[1:]})
        return out


def _finish(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    seg = row["inputs_segment_ids"].astype(np.int32)
    return {"inputs": row["inputs"].astype(np.int32), "targets": row["targets"].astype(np.int32),
            "positions": row["inputs_positions"].astype(np.int32), "segment_ids": seg,
            "weights": (seg != 0).astype(np.float32)}


def check_tokenizer(tok: Tokenizer, config) -> None:
    if tok.vocab_size > config.vocab_size:
        raise ConfigError(f"tokenizer {tok.path} has {tok.vocab_size} ids but vocab_size="
                          f"{config.vocab_size}; raise vocab_size or use a smaller tokenizer")
    for flag, name, tid in (("add_bos", "bos_id", tok.bos_id), ("add_eos", "eos_id", tok.eos_id)):
        if getattr(config, flag) and tid is None:
            raise ConfigError(f"{flag}=true but tokenizer {tok.path} has no {name}; set {name}=N")
        if getattr(config, flag) and tid >= config.vocab_size:
            raise ConfigError(f"{name}={tid} is outside vocab_size={config.vocab_size}")


def text_files(config, split: str, bundled: tuple[str, str] = (BUNDLED_TRAIN, BUNDLED_EVAL)) -> list[str]:
    """The files of `split`: dataset_path / eval_dataset_path, or the bundled (train, eval) pair."""
    if split == "train":
        return sources.expand_paths(config.dataset_path or bundled[0], "dataset_path")
    if config.eval_dataset_path:
        return sources.expand_paths(config.eval_dataset_path, "eval_dataset_path")
    if config.dataset_path:  # a recipe with eval_interval > 0 is refused earlier (maxlite/config.py)
        raise ConfigError(f"dataset_type={config.dataset_type}: set eval_dataset_path for evaluation on your own data")
    return [bundled[1]]


def make_text_dataset(config, split: str, process_index: int, process_count: int,
                      tok: Tokenizer) -> grain.IterDataset:
    check_tokenizer(tok, config)
    files = text_files(config, split)
    keys = sources.split_spec(config.json_keys)
    train = split == "train"
    shuffle = train and config.data_shuffle
    seed = config.data_shuffle_seed
    bad = sources.BadRecords(config.data_bad_record_policy)
    ds: grain.IterDataset = _Records(files, keys, bad, seed, shuffle, True)
    if shuffle and config.data_shuffle_window > 1:
        ds = grain.experimental.WindowShuffleIterDataset(
            ds, window_size=config.data_shuffle_window, seed=seed)
    ds = grain.experimental.FlatMapIterDataset(
        ds, _TokenizeAndCut(tok, config.max_target_length, config.add_bos, config.add_eos))
    length = config.max_target_length
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"inputs": length, "targets": length},
        num_packing_bins=config.packing_bins, seed=seed, shuffle_bins=shuffle)
    return process_batches(ds.map(_finish), config, process_index, process_count)


def process_batches(ds: grain.IterDataset, config, process_index: int, process_count: int) -> grain.IterDataset:
    """Packed rows → global batches → this process's rows of each, prefetched."""
    n = config.global_batch_size // process_count
    ds = ds.batch(config.global_batch_size, drop_remainder=True)
    lo, hi = process_index * n, (process_index + 1) * n
    ds = ds.map(lambda b: {k: v[lo:hi] for k, v in b.items()})
    if config.grain_prefetch > 0:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=config.grain_prefetch)
    return ds
