"""Data for the trainer: `make_iterator(config, split, process_index, process_count)`.

Every `next()` gives this process's rows of one optimizer step's global batch as numpy arrays
`[global_batch_size // process_count, max_target_length]`: inputs, targets (int32), positions,
segment_ids (int32; 1, 2, ... per packed document, 0 = padding), weights (float32). Process p
holds rows [p*n, (p+1)*n), so all processes together read exactly what one process would. The
loop passes its reader's (index, count) as (process_index, process_count) (maxlite/mesh.py
readers): processes that share a sequence (context parallelism across processes) read the same rows.
`get_state()`/`set_state()` (small, JSON-serialisable) restore the exact next batch;
`batches_read` is the number of global batches read before it (the position in the global order). The alignment
data (data/preference.py) has its own row layout; its `host_` arrays stay on the host.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

import numpy as np

from maxlite.config import ConfigError

class DataIterator:
    """A grain iterator plus a fingerprint, so a checkpoint's data state cannot be mis-applied."""

    def __init__(self, it, fingerprint: dict[str, Any], copy: bool = False):
        self._it, self.fingerprint, self._copy = it, fingerprint, copy
        self.batches_read = 0  # the position in the global order: global batches read before the next
        _OPEN.add(self)

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self) -> dict:
        batch = next(self._it)
        self.batches_read += 1
        if self._copy:  # worker batches live in shared memory: own a plain copy, leak nothing
            batch = {k: np.array(v) for k, v in batch.items()}
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "grain": self._it.get_state(), "batches_read": self.batches_read}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("fingerprint", {})
        for key in ("dataset_type", "max_target_length", "global_batch_size", "grain_worker_count"):
            if key in saved and saved[key] != self.fingerprint[key]:
                raise ConfigError(
                    f"the checkpoint's data state was saved with {key}={saved[key]}, this run has "
                    f"{self.fingerprint[key]}; resume with the same data settings")
        self._it.set_state(state["grain"])
        self.batches_read = int(state.get("batches_read", 0))

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:
            close()
        self._it = None  # let grain's iterators go now, while the interpreter is whole
        _OPEN.discard(self)


# grain's prefetch threads must stop before the interpreter tears modules down.
_OPEN: "weakref.WeakSet[DataIterator]" = weakref.WeakSet()
def _close_all() -> None:
    import gc
    for it in list(_OPEN):
        it.close()
    gc.collect()


atexit.register(_close_all)


def _read_options(config):
    import grain
    return grain.ReadOptions(num_threads=config.grain_threads,
                             prefetch_buffer_size=config.grain_prefetch)


def check(config) -> None:
    """The data's files and tokenizer, read as the iterators read them but without a batch: what a
    launcher checks before a job starts (the Ray driver, the Slurm launcher). One line for each
    mistake (a missing file, a tokenizer that does not fit the vocabulary, a bad .idx)."""
    splits = ["train", "eval"] if config.eval_interval > 0 else ["train"]
    if config.dataset_type == "synthetic":
        return
    if config.dataset_type == "indexed":
        from maxlite.data.indexed import IndexedDataset
        for key in ("data_prefix", "eval_data_prefix"):
            for _, prefix in config.blend(key):
                if "://" not in prefix:  # gs:// prefixes are staged (data/stage.py) when the job starts
                    IndexedDataset(prefix)
        return
    from maxlite.data.text_pipeline import check_tokenizer
    from maxlite.data.tokenizer import load_tokenizer
    check_tokenizer(load_tokenizer(config.tokenizer_path, config.bos_id, config.eos_id), config)
    if config.dataset_type == "text":
        from maxlite.data.text_pipeline import text_files as files
    elif config.dataset_type == "sft":
        from maxlite.data.sft_pipeline import sft_files as files
    else:
        from maxlite.data.preference import files
    for split in splits:
        files(config, split)


def make_iterator(config, split: str, process_index: int, process_count: int):
    """The data iterator of `split` ("train" | "eval") for this process."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be train or eval, got {split!r}")
    # the recipe was validated (maxlite.config): dataset_type, the blend, the split, the batch
    if config.dataset_type == "synthetic":
        from maxlite.data.synthetic import make_synthetic_iterator
        return make_synthetic_iterator(config, split, process_index, process_count)
    fingerprint = {"dataset_type": config.dataset_type, "split": split,
                   "max_target_length": config.max_target_length,
                   "global_batch_size": config.global_batch_size,
                   "grain_worker_count": config.grain_worker_count if config.dataset_type == "indexed" else 0}
    if config.dataset_type == "text":
        from maxlite.data.text_pipeline import make_text_dataset
        from maxlite.data.tokenizer import load_tokenizer
        tok = load_tokenizer(config.tokenizer_path, config.bos_id, config.eos_id)
        ds = make_text_dataset(config, split, process_index, process_count, tok)
        return DataIterator(iter(ds), fingerprint)
    if config.dataset_type == "sft":
        from maxlite.data.sft_pipeline import make_sft_dataset
        from maxlite.data.tokenizer import load_tokenizer
        tok = load_tokenizer(config.tokenizer_path, config.bos_id, config.eos_id)
        ds = make_sft_dataset(config, split, process_index, process_count, tok)
        return DataIterator(iter(ds), fingerprint)
    if config.dataset_type in ("preference", "prompts"):
        from maxlite.data.preference import make_dataset
        from maxlite.data.tokenizer import load_tokenizer
        tok = load_tokenizer(config.tokenizer_path, config.bos_id, config.eos_id)
        return DataIterator(iter(make_dataset(config, split, process_index, process_count, tok)), fingerprint)
    from maxlite.data.gpt_dataset import make_indexed_dataset
    from maxlite.data.stage import stager
    ds = make_indexed_dataset(config, split, process_index, process_count, stager(config))
    it_ds = ds.to_iter_dataset(_read_options(config))
    if config.grain_worker_count > 0:
        import grain
        from absl import flags
        flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.grain_worker_count))
    return DataIterator(iter(it_ds), fingerprint, copy=config.grain_worker_count > 0)
