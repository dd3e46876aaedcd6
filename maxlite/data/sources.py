"""Raw text files, streamed record by record: jsonl, json (array), .gz, .zst, parquet, arrow, txt.

Paths may be files, directories (searched recursively) or globs, comma-separated. Malformed
records are never dropped silently: `BadRecords` counts them, reports the first few as
file:line, and raises under `data_bad_record_policy=error`.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import sys
from typing import Any, Callable, Iterator, Sequence

from maxlite.config import ConfigError

TEXT_SUFFIXES = (".jsonl", ".json", ".ndjson", ".txt", ".parquet", ".arrow")
COMPRESSIONS = ("", ".gz", ".zst")
MAX_REPORTED = 5
JSON_CHUNK = 1 << 16  # characters read at a time from a .json array


def _known(path: str) -> bool:
    return any(path.endswith(s + c) for s in TEXT_SUFFIXES for c in COMPRESSIONS)


def split_spec(spec: str | Sequence[str]) -> list[str]:
    if isinstance(spec, str):
        return [s.strip() for s in spec.split(",") if s.strip()]
    return [str(s) for s in spec]


def expand_paths(spec: str | Sequence[str], what: str = "dataset_path") -> list[str]:
    """Files, directories and globs → a sorted, de-duplicated list of readable files."""
    out: list[str] = []
    for item in split_spec(spec):
        if "://" in item:
            raise ConfigError(f"{what}: {item}: remote text is not read directly; copy it locally, or "
                              f"preprocess it to .bin/.idx and use dataset_type=indexed (gs:// is staged)")
        if os.path.isdir(item):
            found = sorted(os.path.join(r, f) for r, _, fs in os.walk(item) for f in fs
                           if _known(f))
            if not found:
                raise ConfigError(f"{what}: directory {item} holds no {'/'.join(TEXT_SUFFIXES)} files")
            out += found
        elif any(ch in item for ch in "*?["):
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not found:
                raise ConfigError(f"{what}: glob {item} matches no file")
            out += found
        elif os.path.isfile(item):
            out.append(item)
        else:
            raise ConfigError(f"{what}: {item} not found")
    if not out:
        raise ConfigError(f"{what} is empty: give files, directories or globs")
    return list(dict.fromkeys(out))


class Bad:
    """A record that could not be parsed; carries the reason."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class BadRecords:
    """Counts malformed records; reports the first few; raises under policy `error`."""

    def __init__(self, policy: str = "skip", stream=None, hold: bool = False):
        if policy not in ("skip", "error"):
            raise ConfigError(f"data_bad_record_policy={policy!r}: choose skip or error")
        self.policy, self.count, self.first = policy, 0, []
        self.silent = False  # set while re-reading records already counted (restore)
        self._stream = stream if stream is not None else sys.stderr
        # hold: keep the report lines until release(); when no record at all was good, the caller
        # says so in one line instead of a line per record
        self._held: list[str] | None = [] if hold else None

    def release(self) -> None:
        """Print the held lines (a good record was seen); report directly from now on."""
        held, self._held = self._held, None
        for line in held or ():
            print(line, file=self._stream)

    def add(self, path: str, line: int, reason: str) -> None:
        where = f"{path}:{line}" if line > 0 else path
        if self.policy == "error":
            raise ConfigError(f"{where}: malformed record ({reason}); skip such records with "
                              f"data_bad_record_policy=skip (preprocess: --bad-record-policy skip)")
        if self.silent:
            return
        self.count += 1
        if len(self.first) < MAX_REPORTED:
            self.first.append(f"{where}: {reason}")
            line = f"maxlite: data: skipping malformed record {where}: {reason}"
            if self._held is not None:
                self._held.append(line)
            else:
                print(line, file=self._stream)

    def summary(self) -> str:
        return f"{self.count} malformed record(s) skipped" + (
            f" (first: {'; '.join(self.first)})" if self.first else "")


class _ZstdReader(io.RawIOBase):
    """Streams every frame of a .zst file; a file cut inside a frame raises EOFError
    (zstandard's own stream reader just stops there, which would drop records silently)."""

    def __init__(self, path: str):
        import zstandard
        self._zstd, self._f = zstandard, open(path, "rb")
        self._d, self._buf, self._fed = zstandard.ZstdDecompressor().decompressobj(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, out) -> int:
        while not self._buf:
            chunk = self._f.read(1 << 17)
            if not chunk:
                if self._fed and not self._d.eof:
                    raise EOFError("zstd stream ends inside a frame")
                return 0
            while chunk:
                if self._d.eof:  # next frame
                    self._d = self._zstd.ZstdDecompressor().decompressobj()
                try:
                    self._buf += self._d.decompress(chunk)
                except self._zstd.ZstdError as e:
                    raise ValueError(f"zstd: {e}") from None
                self._fed = True
                chunk = self._d.unused_data if self._d.eof else b""
        n = min(len(out), len(self._buf))
        out[:n], self._buf = self._buf[:n], self._buf[n:]
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="strict")
    if path.endswith(".zst"):
        return io.TextIOWrapper(io.BufferedReader(_ZstdReader(path), 1 << 16), encoding="utf-8",
                                errors="strict")
    return open(path, "rt", encoding="utf-8", errors="strict")


def _iter_jsonl(f) -> Iterator[tuple[int, Any]]:
    for n, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            yield n, Bad(f"invalid JSON: {e.msg}")


def _iter_json_array(f) -> Iterator[tuple[int, Any]]:
    """Stream the elements of a top-level JSON array without loading the file."""
    dec, buf, pos, line, eof = json.JSONDecoder(), "", 0, 1, False
    started = False

    def fill() -> bool:
        nonlocal buf, pos, eof
        chunk = f.read(JSON_CHUNK)
        buf, pos = buf[pos:] + chunk, 0
        eof = not chunk
        return bool(chunk)

    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,[]":
            if buf[pos] == "[":
                started = True
            if buf[pos] == "\n":
                line += 1
            if buf[pos] == "]":
                return
            pos += 1
        if pos >= len(buf):
            if not fill():
                return
            continue
        if not started:
            yield line, Bad("a .json file must hold an array of records (use .jsonl for one per line)")
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            if not eof and fill():
                continue
            yield line, Bad(f"invalid JSON: {e.msg}")
            return
        if end == len(buf) and not eof and fill():  # a number may continue in the next chunk
            continue
        yield line, obj
        line += buf.count("\n", pos, end)
        pos = end


def _iter_arrow_table(batches) -> Iterator[tuple[int, Any]]:
    n = 0
    for batch in batches:
        for row in batch.to_pylist():
            n += 1
            yield n, row


def iter_records(path: str) -> Iterator[tuple[int, Any]]:
    """(line or row number, record | Bad) for every record of a file, streamed."""
    base = path[:-4] if path.endswith(".zst") else path[:-3] if path.endswith(".gz") else path
    try:
        if base.endswith(".parquet"):
            import pyarrow.parquet as pq
            yield from _iter_arrow_table(pq.ParquetFile(path).iter_batches(batch_size=1024))
            return
        if base.endswith(".arrow"):
            import pyarrow as pa
            import pyarrow.ipc as ipc
            source = pa.memory_map(path)
            try:
                reader = ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                source.seek(0)
                batches = ipc.open_stream(source)
            yield from _iter_arrow_table(batches)
            return
        with _open_text(path) as f:
            if base.endswith(".txt"):
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield n, {"text": line.rstrip("\n")}
            elif base.endswith(".json"):
                yield from _iter_json_array(f)
            else:
                yield from _iter_jsonl(f)
    except UnicodeDecodeError as e:
        yield -1, Bad(f"not UTF-8 text ({e.reason}); file skipped from here")
    except (EOFError, OSError, ValueError) as e:  # truncated gzip/zstd, broken parquet/arrow
        if isinstance(e, FileNotFoundError):
            raise ConfigError(f"{path}: not found") from None
        yield -1, Bad(f"unreadable or truncated file ({type(e).__name__}: {str(e)[:100]}); file skipped from here")


def texts_of(record: Any, keys: Sequence[str]) -> list[str] | str:
    """The texts under `keys`, or a reason string when the record is malformed."""
    if isinstance(record, Bad):
        return record.reason
    if not isinstance(record, dict):
        return f"record is a {type(record).__name__}, not an object"
    out = []
    for k in keys:
        v = record.get(k)
        if v is None:
            return f"no field '{k}' (json_keys={','.join(keys)})"
        if not isinstance(v, str):
            return f"field '{k}' is a {type(v).__name__}, not a string"
        out.append(v)
    return out


def iter_documents(path: str, keys: Sequence[str], bad: BadRecords,
                   parse: Callable[[Any], Any] | None = None) -> Iterator[tuple[int, Any]]:
    """(record number, texts) of the well-formed records of one file; bad ones go to `bad`.
    `parse(record)` replaces the texts under `keys` (a string return is the reason it is bad)."""
    for n, rec in iter_records(path):
        texts = texts_of(rec, keys) if parse is None else (rec.reason if isinstance(rec, Bad) else parse(rec))
        if isinstance(texts, str):
            bad.add(path, n, texts)
            continue
        yield n, texts


def iter_texts(files: Sequence[str], keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Every text of every file (for tokenizer training); bad records are skipped and reported."""
    bad = BadRecords("skip")
    for path in expand_paths(files, "--input"):
        for _, texts in iter_documents(path, keys, bad):
            yield from texts
