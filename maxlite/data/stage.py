"""Stage `gs://` data once into a local cache (resumable, verified), then memory-map it.

A download continues from its `.part` file after an interruption, is checked against the
object's size and CRC32C, and is renamed into place only when complete; an `.ok` marker with
the object's generation makes later runs skip it. A file lock lets several processes on one
host share the cache.
"""

from __future__ import annotations

import base64
import fcntl
import os
import sys

from maxlite.config import ConfigError
from maxlite.outcome import TransientError


def cache_root(config) -> str:
    return config.data_cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "maxlite", "data")


def _client():
    from google.cloud import storage
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials
        return storage.Client(project="local", credentials=AnonymousCredentials())
    return storage.Client()


def _crc32c(path: str) -> str:
    import google_crc32c
    h = google_crc32c.Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return base64.b64encode(h.digest()).decode()


def stage_file(url: str, local: str, client=None) -> str:
    """Download `gs://bucket/name` to `local` unless an up-to-date verified copy is there."""
    bucket_name, _, name = url[len("gs://"):].partition("/")
    client = client or _client()
    blob = client.bucket(bucket_name).get_blob(name)
    if blob is None:
        raise ConfigError(f"{url} not found")
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    marker, part = f"{local}.ok", f"{local}.part"
    stamp = f"{blob.generation} {blob.size} {blob.crc32c}"
    with open(f"{local}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(local) and os.path.exists(marker) and open(marker).read() == stamp:
            return local
        have = os.path.getsize(part) if os.path.exists(part) else 0
        if have > blob.size:
            have = 0
            os.remove(part)
        if have < blob.size:
            print(f"maxlite: staging {url} → {local} ({blob.size / 1e6:.1f} MB"
                  f"{f', resuming at {have / 1e6:.1f} MB' if have else ''})", file=sys.stderr)
            with open(part, "ab") as f:
                blob.download_to_file(f, start=have, checksum=None)
        if os.path.getsize(part) != blob.size or (blob.crc32c and _crc32c(part) != blob.crc32c):
            os.remove(part)
            raise TransientError(f"{url}: staged copy failed verification (size/CRC32C; the download "
                                 f"was damaged on the way): run again to download it anew")
        os.replace(part, local)
        with open(marker, "w") as f:
            f.write(stamp)
    return local


def stage_prefix(prefix: str, root: str, client=None) -> str:
    """The local prefix holding a verified copy of `gs://.../prefix.{idx,bin}`."""
    local = os.path.join(root, prefix[len("gs://"):])
    client = client or _client()
    for ext in (".idx", ".bin"):
        stage_file(prefix + ext, local + ext, client)
    return local


def stager(config):
    """prefix → local prefix: gs:// ones are staged into the cache, local ones pass through."""
    root = cache_root(config)
    return lambda p: stage_prefix(p, root) if p.startswith("gs://") else p
