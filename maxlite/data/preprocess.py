"""jsonl/json/parquet/arrow text → Megatron `.bin/.idx`, NeMo/Megatron style.

    python -m maxlite.data.preprocess --input PATHS --output-prefix OUT --tokenizer TOK \\
        --json-keys text --append-eod --workers N [--rank R --world-size W]
    python -m maxlite.data.preprocess merge --inputs OUT_part*_text_document --output-prefix OUT_text_document

Writes `{OUT}_{key}_document.bin/.idx` (uint16 tokens when the vocabulary has < 65,500 ids,
else int32). With a world size > 1 each rank writes `{OUT}_part{R}of{W}_{key}_document` from a
disjoint share (whole files when there are enough, else every W-th record); `merge` joins them.
Each worker tokenizes batches of documents with one core (batched fast tokenization).
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any, Iterator, Sequence

import numpy as np

from maxlite import cli
from maxlite.config import ConfigError, resolve_path
from maxlite.data import indexed, sources
from maxlite.data.tokenizer import Tokenizer, load_gpt2, load_tokenizer

BATCH_DOCS = 256  # documents per task sent to a worker
_WORKER: dict[str, Any] = {}


def _init_worker(tok: Tokenizer, eod: list[int], dtype) -> None:
    _WORKER.update(tok=tok, eod=np.asarray(eod, np.int32), dtype=dtype)


def _encode(task: tuple[list[list[str]], int]) -> tuple[list[tuple[np.ndarray, np.ndarray, int]], int]:
    """Per key: (tokens of the non-empty documents + EOD, concatenated; their lengths; empties),
    and the task's text bytes (passed through, so progress counts what was written)."""
    texts_by_key, nbytes = task
    out = []
    for texts in texts_by_key:
        docs = [np.concatenate([ids, _WORKER["eod"]]) for ids in _WORKER["tok"].encode_batch(texts)
                if len(ids)]
        tokens = np.concatenate(docs).astype(_WORKER["dtype"]) if docs else np.zeros(0, _WORKER["dtype"])
        out.append((tokens, np.asarray([len(d) for d in docs], np.int64), len(texts) - len(docs)))
    return out, nbytes


def _shard(files: list[str], rank: int, world: int) -> tuple[list[str], int, int]:
    """(files, record stride, record offset) of this rank's share."""
    if world == 1:
        return files, 1, 0
    if len(files) >= world:
        return files[rank::world], 1, 0
    return files, world, rank


def _batches(files: list[str], keys: list[str], bad: sources.BadRecords, stride: int,
             offset: int) -> Iterator[tuple[list[list[str]], int]]:
    batch: list[list[str]] = [[] for _ in keys]
    i = nbytes = 0
    for path in files:
        for _, texts in sources.iter_documents(path, keys, bad):
            i += 1
            if (i - 1) % stride != offset:
                continue
            nbytes += sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
            for b, t in zip(batch, texts):
                b.append(t)
            if len(batch[0]) >= BATCH_DOCS:
                yield batch, nbytes
                batch, nbytes = [[] for _ in keys], 0
    if batch[0]:
        yield batch, nbytes


def _context():
    """fork is cheap (no re-import) but only safe while this process runs no other thread."""
    if "fork" in mp.get_all_start_methods() and threading.active_count() == 1:
        return mp.get_context("fork")
    return mp.get_context("spawn")


def output_prefix(out: str, key: str, rank: int = 0, world: int = 1) -> str:
    part = f"_part{rank:03d}of{world:03d}" if world > 1 else ""
    return f"{out}{part}_{key}_document"


def preprocess(inputs: Sequence[str], out: str, tok: Tokenizer, keys: Sequence[str] = ("text",),
               append_eod: bool = True, workers: int = 1, rank: int = 0, world: int = 1,
               bad_policy: str = "skip", progress: bool = True) -> dict[str, Any]:
    """Tokenize `inputs` into `.bin/.idx` pairs; returns figures (docs, tokens, bytes, seconds)."""
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} must be in [0, --world-size {world})")
    if append_eod and tok.eos_id is None:
        raise ConfigError(f"--append-eod: tokenizer {tok.path} has no end-of-document token")
    files, stride, offset = _shard(sources.expand_paths(inputs, "--input"), rank, world)
    keys = list(keys)
    bad = sources.BadRecords(bad_policy, hold=True)  # released at the first good document
    dtype = indexed.best_dtype(tok.vocab_size)
    prefixes = [output_prefix(out, k, rank, world) for k in keys]
    writers = [indexed.IndexedWriter(p, dtype) for p in prefixes]
    stats: dict[str, Any] = {"docs": 0, "empty": 0, "tokens": 0, "bytes": 0, "workers": workers,
                             "files": len(files), "outputs": prefixes}
    init = (tok, [tok.eos_id] if append_eod else [], dtype)
    start = last = time.perf_counter()
    batches = _batches(files, keys, bad, stride, offset)
    pool = _context().Pool(workers, _init_worker, init) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(*init)
            results = map(_encode, batches)
        else:
            results = pool.imap(_encode, batches, chunksize=1)
        for encoded, nbytes in results:
            stats["bytes"] += nbytes
            for writer, (tokens, lengths, empty) in zip(writers, encoded):
                writer.add_documents_flat(tokens, lengths)
                stats["empty"] += empty
            stats["docs"] += len(encoded[0][1]) + encoded[0][2]
            if stats["docs"]:
                bad.release()
            stats["tokens"] = sum(w.num_tokens for w in writers)
            now = time.perf_counter()
            if progress and now - last > 2:
                last = now
                _report(stats, now - start, end="\r" if sys.stderr.isatty() else "\n")
    except BaseException:
        for w in writers:
            w._bin.close()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    for w in writers:
        w.finalize()
    stats["tokens"] = sum(w.num_tokens for w in writers)
    stats["seconds"] = time.perf_counter() - start
    stats["bad_records"] = bad.count
    if stats["tokens"] == 0:
        for p in prefixes:
            for f in (indexed.bin_path(p), indexed.idx_path(p)):
                os.remove(f)
        if bad.count and not stats["docs"]:
            raise ConfigError(f"every record of {', '.join(files[:3])} is malformed ({bad.count} records; "
                              f"first: {bad.first[0]})")
        raise ConfigError(f"no documents in {', '.join(files[:3])} ({bad.summary()})")
    if progress:
        _report(stats, stats["seconds"], end="\n")
        if bad.count:
            print(f"maxlite: data: {bad.summary()}", file=sys.stderr)
    return stats


def _report(s: dict[str, Any], seconds: float, end: str) -> None:
    sec = max(seconds, 1e-9)
    print(f"preprocess: {s['docs']} docs ({s['docs'] / sec:.0f} docs/s), "
          f"{s['bytes'] / 1e6:.1f} MB ({s['bytes'] / 1e6 / sec:.2f} MB/s), "
          f"{s['tokens'] or ''}{' tokens, ' if s['tokens'] else ''}{seconds:.1f}s", end=end,
          file=sys.stderr, flush=True)


def _merge_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m maxlite.data.preprocess merge",
                                 description="concatenate .bin/.idx partitions, in the order given")
    ap.add_argument("--inputs", nargs="+", required=True, help="prefixes or globs (sorted)")
    ap.add_argument("--output-prefix", required=True)
    args = ap.parse_args(argv)
    prefixes: list[str] = []
    for item in args.inputs:
        if any(ch in item for ch in "*?["):
            found = sorted({p[:-4] for p in glob.glob(item + ("" if item.endswith(".idx") else ".idx"))})
            if not found:
                raise ConfigError(f"merge: {item} matches no .idx file")
            prefixes += found
        else:
            prefixes.append(item[:-4] if item.endswith((".idx", ".bin")) else item)
    ds = indexed.merge(prefixes, args.output_prefix)
    print(f"merged {len(prefixes)} partitions → {args.output_prefix}.bin/.idx: "
          f"{ds.num_documents} docs, {ds.num_tokens} tokens")
    return 0


def _tokenizer_from_args(args) -> Tokenizer:
    if args.vocab_file or args.merge_file:  # NeMo/Megatron style GPT-2 BPE flags
        if not (args.vocab_file and args.merge_file):
            raise ConfigError("--vocab-file and --merge-file go together (GPT-2 BPE)")
        return load_gpt2(args.vocab_file, args.merge_file)
    return load_tokenizer(args.tokenizer or "")


@cli.entry_point()
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers scales
    if argv[:1] == ["merge"]:
        return _merge_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m maxlite.data.preprocess",
                                 description=__doc__.split("\n")[0] + " (or: merge --help)")
    ap.add_argument("--input", nargs="+", required=True, help="files, directories or globs")
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--tokenizer", default="", help="tokenizer.json, .model or dir; default: bundled")
    ap.add_argument("--vocab-file", default="", help="GPT-2 vocab.json (NeMo style, with --merge-file)")
    ap.add_argument("--merge-file", default="")
    ap.add_argument("--json-keys", nargs="+", default=["text"])
    ap.add_argument("--append-eod", action="store_true")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)))
    ap.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    ap.add_argument("--bad-record-policy", choices=("skip", "error"), default="skip")
    ap.add_argument("--dataset-impl", choices=("mmap",), default="mmap", help="accepted for NeMo compatibility")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.workers < 1:
        raise ConfigError("--workers must be >= 1")
    args.input = [resolve_path(p) for p in args.input]
    args.output_prefix = resolve_path(args.output_prefix)
    stats = preprocess(args.input, args.output_prefix, _tokenizer_from_args(args), args.json_keys,
                       args.append_eod, args.workers, args.rank, args.world_size,
                       args.bad_record_policy, not args.quiet)
    for p in stats["outputs"]:
        print(f"wrote {p}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
