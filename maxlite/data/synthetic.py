"""dataset_type=synthetic: deterministic, learnable random batches, new every step.

Row r of step s is an arithmetic progression modulo min(vocab_size, 512) with a random start and a
stride in [1, 8], drawn from a generator seeded by (seed, split, s, r): any process can produce any
row, so hosts read disjoint rows of the same global batch and a resumed run sees the very same
batches. The structure lets the loss fall (first to ~log 512 as unused ids are learned, then towards
log 8), which uniform noise would not.
"""

from __future__ import annotations

import numpy as np

_SPLIT_SALT = {"train": 0, "eval": 1}


class SyntheticIterator:
    def __init__(self, config, split: str, process_index: int, process_count: int):
        self.modulus, self.length = min(config.vocab_size, 512), config.max_target_length
        self.seed, self.salt = config.seed, _SPLIT_SALT[split]
        rows = config.global_batch_size // process_count
        self.rows = range(process_index * rows, (process_index + 1) * rows)
        self.step = 0
        self.images = _Images(config) if config.vision_encoder else None

    def __iter__(self):
        return self

    def _row(self, r: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, self.salt, self.step, r))
        start, stride = rng.integers(0, self.modulus), rng.integers(1, 9)
        return (start + stride * np.arange(self.length + 1)) % self.modulus

    def __next__(self) -> dict[str, np.ndarray]:
        tokens = np.stack([self._row(r) for r in self.rows]).astype(np.int32)
        shape = (len(self.rows), self.length)
        batch = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.broadcast_to(np.arange(self.length, dtype=np.int32), shape).copy(),
            "segment_ids": np.ones(shape, np.int32),
            "weights": np.ones(shape, np.float32),
        }
        if self.images is not None:
            batch = self.images.add(batch, [np.random.default_rng((self.seed, self.salt, self.step, r, 1))
                                            for r in self.rows])
        self.step += 1
        return batch

    @property
    def batches_read(self) -> int:
        return self.step

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def close(self) -> None:
        pass


class _Images:
    """A vision model's synthetic rows: one random image per row after the row's first token, as its
    encoder kind's markers and image tokens (image_docs: qwen_vit a 4 × 4 patch grid, with
    multimodal positions; siglip one vision_image_size square); the rest of the row as before, but
    for tokens equal to the image placeholder (a vocabulary under 512 holds it), which become 0."""

    def __init__(self, config):
        from maxlite.data.image_docs import kind_of

        self.kind = kind_of(config)

    def add(self, batch: dict, rngs) -> dict:
        markers = self.kind.synthetic_markers()
        inputs, positions, arrays = batch["inputs"].copy(), [], {k: [] for k in self.kind.ROW_KEYS}
        placeholder = self.kind.cfg.image_token_id
        for row, rng in zip(inputs, rngs):
            row[row == placeholder] = 0  # the progression's own placeholders would be images without pixels
            row[1:1 + len(markers)] = markers
            row_positions, row_arrays = self.kind.synthetic(row, rng)
            positions.append(row_positions)
            for k, v in row_arrays.items():
                arrays[k].append(v)
        targets = np.concatenate([inputs[:, 1:], batch["targets"][:, -1:]], axis=1)
        weights = batch["weights"] * ~np.isin(targets, markers[:-1])  # no loss on predicting the image
        out = {**batch, "inputs": inputs, "targets": targets, "weights": weights.astype(np.float32),
               **{k: np.stack(v) for k, v in arrays.items()}}
        if positions[0] is not None:  # multimodal RoPE's
            out["positions"] = np.stack(positions).astype(np.int32)
        return out


def make_synthetic_iterator(config, split: str, process_index: int, process_count: int):
    return SyntheticIterator(config, split, process_index, process_count)
