"""Tokenizers, all offline: HF `tokenizer.json`, sentencepiece `.model`, GPT-2 `vocab.json`+`merges.txt`.

`python -m maxlite.data.tokenizer train --input FILES --vocab-size N --output DIR` trains a
byte-level BPE locally (what the bundled 4096-id tokenizer was made with).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Iterable, Sequence

import numpy as np

from maxlite import cli
from maxlite.config import ConfigError

BUNDLED_DIR = pathlib.Path(__file__).parent / "bundled"
EOD_TOKEN = "<|endoftext|>"
_EOS_NAMES = (EOD_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>", EOD_TOKEN)


class Tokenizer:
    """A uniform face over `tokenizers` and `sentencepiece`: batched encode, ids of BOS/EOD."""

    def __init__(self, path: str, backend, vocab_size: int, bos_id: int | None, eos_id: int | None):
        self.path, self._backend = path, backend
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, bos_id, eos_id

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        if hasattr(self._backend, "encode_batch_fast"):
            encs = self._backend.encode_batch_fast(list(texts), add_special_tokens=False)
            return [np.asarray(e.ids, np.int32) for e in encs]
        if hasattr(self._backend, "encode_batch"):  # older tokenizers
            encs = self._backend.encode_batch(list(texts), add_special_tokens=False)
            return [np.asarray(e.ids, np.int32) for e in encs]
        return [np.asarray(ids, np.int32) for ids in self._backend.encode(list(texts))]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids: Iterable[int]) -> str:
        return self._backend.decode([int(i) for i in ids])

    def __reduce__(self):  # picklable for grain worker processes / preprocess workers
        if self.path.endswith("|merges"):
            vocab, merges = self.path[:-len("|merges")].split("|")
            return (load_gpt2, (vocab, merges, self.bos_id, self.eos_id))
        return (load_tokenizer, (self.path, self.bos_id, self.eos_id))


def _special_id(tok, names: Sequence[str]) -> int | None:
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def _from_hf(path: pathlib.Path):
    from tokenizers import Tokenizer as HFTokenizer
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # the library raises plain Exception for bad files
        raise ConfigError(f"tokenizer {path}: cannot load ({str(e).splitlines()[0][:120]})") from None
    return tok


def _from_gpt2(vocab: pathlib.Path, merges: pathlib.Path):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    try:
        tok = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:
        raise ConfigError(f"tokenizer {vocab}: cannot load vocab/merges ({str(e)[:120]})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def load_tokenizer(path: str = "", bos_id: int | None = None, eos_id: int | None = None) -> Tokenizer:
    """Load by format; `path=""` is the bundled tokenizer. Unknown format → ConfigError."""
    bos_id = None if bos_id is None or bos_id < 0 else bos_id
    eos_id = None if eos_id is None or eos_id < 0 else eos_id
    p = pathlib.Path(path) if path else BUNDLED_DIR
    if not p.exists():
        raise ConfigError(f"tokenizer_path {path}: not found (give a tokenizer.json, a .model, or a directory)")
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (p / name).is_file():
                return load_tokenizer(str(p / name), bos_id, eos_id)
        if (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            return load_tokenizer(str(p / "vocab.json"), bos_id, eos_id)
        raise ConfigError(f"tokenizer_path {p}: no tokenizer.json, tokenizer.model or vocab.json+merges.txt in it")
    if p.suffix == ".model":
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor()
        try:
            sp.Load(str(p))
        except (OSError, RuntimeError) as e:
            raise ConfigError(f"tokenizer {p}: not a sentencepiece model ({str(e)[:100]})") from None
        bos = bos_id if bos_id is not None else (sp.bos_id() if sp.bos_id() >= 0 else None)
        eos = eos_id if eos_id is not None else (sp.eos_id() if sp.eos_id() >= 0 else None)
        return Tokenizer(str(p), sp, sp.GetPieceSize(), bos, eos)
    if p.suffix == ".json" and p.name != "vocab.json":
        tok = _from_hf(p)
    elif p.name == "vocab.json" or p.suffix == ".txt":
        vocab, merges = p.parent / "vocab.json", p.parent / "merges.txt"
        if not (vocab.is_file() and merges.is_file()):
            raise ConfigError(f"tokenizer {p}: GPT-2 style needs vocab.json and merges.txt side by side")
        tok = _from_gpt2(vocab, merges)
    else:
        raise ConfigError(
            f"tokenizer {p}: unknown tokenizer format (use tokenizer.json, a sentencepiece .model, "
            f"or vocab.json + merges.txt)")
    bos = bos_id if bos_id is not None else _special_id(tok, _BOS_NAMES)
    eos = eos_id if eos_id is not None else _special_id(tok, _EOS_NAMES)
    return Tokenizer(str(p), tok, tok.get_vocab_size(with_added_tokens=True), bos, eos)


def load_gpt2(vocab: str, merges: str, bos_id: int | None = None, eos_id: int | None = None) -> Tokenizer:
    """GPT-2 BPE from a vocab.json and a merges.txt of any names (NeMo's --vocab-file/--merge-file)."""
    for f in (vocab, merges):
        if not os.path.isfile(f):
            raise ConfigError(f"tokenizer file {f} not found")
    tok = _from_gpt2(pathlib.Path(vocab), pathlib.Path(merges))
    bos = bos_id if bos_id is not None and bos_id >= 0 else _special_id(tok, _BOS_NAMES)
    eos = eos_id if eos_id is not None and eos_id >= 0 else _special_id(tok, _EOS_NAMES)
    return Tokenizer(f"{vocab}|{merges}|merges", tok, tok.get_vocab_size(with_added_tokens=True), bos, eos)


def train(files: Sequence[str], vocab_size: int, output: str, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) on text or jsonl files; writes tokenizer.json,
    vocab.json and merges.txt (the latter two for Megatron/NeMo's GPT2BPETokenizer)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from maxlite.data.sources import iter_texts

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=sys.stderr.isatty())
    tok.train_from_iterator(iter_texts(files), trainer=trainer)
    out = pathlib.Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        print(f"maxlite: warning: corpus too small, trained {got} ids instead of {vocab_size}",
              file=sys.stderr)
    return load_tokenizer(str(out / "tokenizer.json"))


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m maxlite.data.tokenizer")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a byte-level BPE tokenizer locally")
    t.add_argument("--input", nargs="+", required=True, help="text, jsonl(.gz/.zst), json, parquet files")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--output", required=True, help="directory for tokenizer.json, vocab.json, merges.txt")
    t.add_argument("--min-frequency", type=int, default=2)
    i = sub.add_parser("info", help="print a tokenizer's size and special ids")
    i.add_argument("path", nargs="?", default="")
    args = ap.parse_args(argv)
    if args.cmd == "train":
        tok = train(args.input, args.vocab_size, args.output, args.min_frequency)
    else:
        tok = load_tokenizer(args.path)
    print(f"tokenizer {tok.path}: vocab_size={tok.vocab_size} bos_id={tok.bos_id} eos_id={tok.eos_id}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
