"""dataset_type=sft: chat records streamed → shuffled in a window → rendered and masked → packed →
batched, as dataset_type=text does for plain text (data/text_pipeline.py), resumable the same way.

Each conversation becomes one packed document: inputs = ids[:-1], targets = ids[1:], and the loss
weight of a target is 1 when that token belongs to an assistant answer (data/chat.py), so packing
keeps documents apart (segment ids) and the loss covers answers only (`sft_train_on_inputs: true`:
every token). An answer the template rewrites once the conversation goes on (Qwen3's reasoning)
is one more document: the conversation up to that answer (`ChatTemplate.examples`). A conversation longer than `max_target_length + 1` tokens is cut to that length
(the run's audit counts how many: data/sft_audit.py). `dataset_path` "" is the bundled chat set.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import grain
import numpy as np

from maxlite.config import ConfigError
from maxlite.data import chat, image_docs, sources
from maxlite.data.text_pipeline import _Records, check_tokenizer, process_batches, text_files
from maxlite.data.tokenizer import BUNDLED_DIR, Tokenizer

BUNDLED_TRAIN = str(BUNDLED_DIR / "chat_train.jsonl.zst")
BUNDLED_EVAL = str(BUNDLED_DIR / "chat_eval.jsonl.zst")


def sft_files(config, split: str) -> list[str]:
    return text_files(config, split, (BUNDLED_TRAIN, BUNDLED_EVAL))


def examples(template: chat.ChatTemplate, messages, length: int, train_on_inputs: bool) -> list[dict[str, Any]]:
    """One conversation as packable documents (usually one); `truncated` says whether one was cut."""
    out = []
    for ids, mask in template.examples(messages, train_on_inputs):
        truncated = len(ids) > length + 1
        ids, mask = ids[:length + 1], mask[:length + 1]
        out.append({"inputs": ids[:-1], "targets": ids[1:], "weights": mask[1:].astype(np.float32),
                    "truncated": truncated})
    return out


class _RenderAndMask(grain.experimental.FlatMapTransform):
    max_fan_out = 64  # declared by grain's FlatMap; FlatMapIterDataset does not bound it

    def __init__(self, template: chat.ChatTemplate, length: int, train_on_inputs: bool, config=None,
                 bad: sources.BadRecords | None = None):
        self.template, self.length, self.train_on_inputs = template, length, train_on_inputs
        self.config, self.bad = config, bad
        self.refused: set = set()  # (file, record) of the conversations refused so far
        self.taken = 0  # conversations with images turned into documents
        self.images = None
        if config is not None and config.vision_encoder:
            self.images = image_docs.kind_of(config)

    def flat_map(self, element: dict[str, Any]) -> list[dict[str, np.ndarray]]:
        messages = element["texts"]
        refs = image_docs.image_refs(messages)
        if refs or self.images is not None:
            return self._with_images(element, refs)
        return [{k: ex[k] for k in ("inputs", "targets", "weights")}
                for ex in examples(self.template, messages, self.length, self.train_on_inputs)]

    def _with_images(self, element: dict[str, Any], refs: list) -> list[dict[str, np.ndarray]]:
        """A conversation of a vision model (images or not): its placeholders expanded, its positions
        [T, 3] and its patch arrays (data/image_docs.py). A record that cannot be one (an image for a
        text-only model, a missing or unreadable image, images and placeholders that differ in number,
        more patches than a row holds, image tokens cut by max_target_length) goes to the bad records."""
        path, number = element["path"], element["record"]
        where = f"{path}:{number}"
        try:
            ids, mask, rope, arrays = image_example(self.images, self.template, element["texts"], refs, path, number,
                                                    self.length, self.train_on_inputs)
        except ValueError as e:
            if (path, number) in self.refused and not self.taken:  # a whole epoch read, nothing to train on
                raise ConfigError(f"no usable conversation in the data: every one was refused "
                                  f"({self.bad.summary()})") from None
            self.refused.add((path, number))
            self.bad.add(path, number, str(e).removeprefix(where + ": "))
            return []
        self.taken += 1
        ids, mask = ids[:self.length + 1], mask[:self.length + 1]
        positions = {} if rope is None else {"rope": rope[:len(ids) - 1]}  # multimodal RoPE's, else plain
        return [{"inputs": ids[:-1], "targets": ids[1:], "weights": mask[1:].astype(np.float32),
                 **positions, **arrays}]


def image_example(images, template: chat.ChatTemplate, messages, refs: list, path: str, number: int, length: int,
                  train_on_inputs: bool):
    """(ids, mask, positions or None, image arrays) of a conversation of a vision model (`images`: its
    encoder kind's side, image_docs; None for a text model), each image's placeholder expanded to
    the encoder's tokens; a ValueError naming the record for what cannot be one (an image for a
    text-only model, a missing or unreadable image, images and placeholders that differ in number,
    more patches than a row holds, image tokens cut by max_target_length). The pipeline and the SFT
    audit (data/sft_audit.py) both read a conversation with images through it."""
    from maxlite.data import images as image_io

    where = f"{path}:{number}"
    if images is None:
        raise ValueError("it has an image, but the model has no vision encoder (vision_encoder)")
    pictures = [image_io.load_image(ref, base_dir=os.path.dirname(path), where=where) for ref in refs]
    ids, mask = template.examples(messages, train_on_inputs)[0]
    ids, mask, rope, arrays = image_docs.doc_arrays(images, ids, mask, pictures, where)
    full = images.row_capacity(arrays)
    if full:
        raise ValueError(full)
    if len(ids) > length + 1 and np.any(ids[length + 1:] == images.cfg.image_token_id):
        raise ValueError(f"its image tokens run past max_target_length={length} (an image is never cut)")
    return ids, mask, rope, arrays


def _finish(row: dict[str, np.ndarray], images=None) -> dict[str, np.ndarray]:
    """A packed row as the step reads it; `images` (a vision model's encoder kind, image_docs) adds its
    documents' image arrays (and multimodal positions)."""
    seg = row["inputs_segment_ids"].astype(np.int32)
    out = {"inputs": row["inputs"].astype(np.int32), "targets": row["targets"].astype(np.int32),
           "positions": row["inputs_positions"].astype(np.int32), "segment_ids": seg,
           "weights": row["weights"].astype(np.float32) * (seg != 0)}
    if images is not None:
        images.finish(row, out)
    return out


def make_sft_dataset(config, split: str, process_index: int, process_count: int,
                     tok: Tokenizer) -> grain.IterDataset:
    check_tokenizer(tok, config)
    template = chat.ChatTemplate.for_config(config, tok)
    train = split == "train"
    shuffle = train and config.data_shuffle
    seed = config.data_shuffle_seed
    bad = sources.BadRecords(config.data_bad_record_policy)
    ds: grain.IterDataset = _Records(sft_files(config, split), (), bad, seed, shuffle, True, chat.messages_of)
    if shuffle and config.data_shuffle_window > 1:
        ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=config.data_shuffle_window, seed=seed)
    length = config.max_target_length
    ds = grain.experimental.FlatMapIterDataset(ds, _RenderAndMask(template, length, config.sft_train_on_inputs,
                                                                  config, bad))
    ds = ds.filter(lambda ex: len(ex["inputs"]) > 0)
    lengths = {"inputs": length, "targets": length, "weights": length}
    images = image_docs.kind_of(config) if config.vision_encoder else None
    if images is not None:  # every document's images packed beside its tokens, never split
        lengths.update(images.pack_lengths(length))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct=lengths, num_packing_bins=config.packing_bins, seed=seed, shuffle_bins=shuffle)
    return process_batches(ds.map(functools.partial(_finish, images=images)), config, process_index, process_count)
