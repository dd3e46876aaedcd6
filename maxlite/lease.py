"""One writer per run directory: the primary process holds a lease, `{run_dir}/lease.json`.

The lease is created atomically (local: O_EXCL under a lock file; gs://: a write with the
generation precondition 0, no extra service) and renewed by a heartbeat thread every
`run_lease_seconds / 4`. A launch that finds it held:

- by a later attempt's predecessor of the same job (a Slurm requeue, a Ray group restart, an
  elastic group: the launcher names the job) takes it over at once — the old holder, if it still
  runs, sees its lease gone at its next heartbeat and stops without writing more;
- by a process of this host that is gone (killed -9), or by anyone whose heartbeat is older than
  `run_lease_seconds` (the node vanished), takes it over and says so;
- otherwise is refused with one line naming the holder (host, pid, launcher, since, heartbeat).

The lease is released (deleted) when the run ends; a killed holder leaves it for the rules above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from maxlite.outcome import TransientError
from maxlite.rundir import make_dir

FILE = "lease.json"


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who claims (or holds) a run directory."""

    job: str  # the launcher's job ("slurm:123", "ray:<driver token>"), or "" for a plain launch
    launcher: str  # in words, for the refusal line
    host: str = dataclasses.field(default_factory=socket.gethostname)
    pid: int = dataclasses.field(default_factory=os.getpid)
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    since: float = dataclasses.field(default_factory=time.time)
    oom: tuple | None = dataclasses.field(default_factory=lambda: _oom_counter())  # (file, kills at start)

    def record(self, heartbeat: float) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "heartbeat": heartbeat}


def _oom_counter():
    from maxlite import hostmem

    return hostmem.oom_counter()


def gone_because(record: dict[str, Any]) -> str:
    """Why a holder that is gone went, as far as this host can tell: killed for memory when its
    cgroup's out-of-memory kill count rose since it started, else not known."""
    from maxlite import hostmem

    oom = record.get("oom")
    if oom and record.get("host") == socket.gethostname():
        kills = hostmem.oom_kills(oom[0]) - oom[1]
        if kills > 0:
            return f"killed for memory: its cgroup's OOM killer ran {kills} time(s) since it started ({oom[0]})"
    return "ended without a word (killed, or its machine went away)"


def read(run_dir: str) -> dict[str, Any] | None:
    """The lease record of a run directory, or None."""
    store = _GCS(f"{run_dir}/{FILE}") if run_dir.startswith("gs://") else _Local(f"{run_dir}/{FILE}")
    return store.read()[0]


def describe(record: dict[str, Any], now: float) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("since", 0)))
    return (f"{record.get('launcher', '?')} on host {record.get('host', '?')}, pid {record.get('pid', '?')}, "
            f"since {since}, last heartbeat {now - record.get('heartbeat', 0):.0f} s ago")


def takeover_reason(held: dict[str, Any], me: Holder, timeout: float, now: float) -> str | None:
    """Why `me` may take over the lease `held` (None: it may not) — THE rule."""
    if held.get("job") and held.get("job") == me.job and held.get("since", 0) <= me.since:
        return "a later attempt of the same job"
    return gone(held, timeout, now, me.host)


def gone(held: dict[str, Any], timeout: float, now: float, host: str | None = None) -> str | None:
    """How the holder of `held` is known to be gone (a dead process of `host`, this one by default,
    or no heartbeat for `timeout` seconds), or None."""
    if held.get("host") == (host or socket.gethostname()) and not _alive(int(held.get("pid", -1))):
        return "its process is gone"
    if now - held.get("heartbeat", 0) > timeout:
        return f"no heartbeat for {now - held.get('heartbeat', 0):.0f} s (run_lease_seconds={timeout:g})"
    return None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- where the lease lives: a local file, or a gs:// object with generation preconditions ----


class _Local:
    def __init__(self, path: str):
        self.path = path

    @contextlib.contextmanager
    def locked(self):
        """An exclusive lock on the run directory itself (no file of its own to leave behind)."""
        import fcntl

        fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def read(self) -> tuple[dict | None, Any]:
        try:
            with open(self.path) as f:
                return json.load(f), None
        except FileNotFoundError:
            return None, None
        except ValueError:
            return {}, None  # a torn file (the writer died mid-write): anyone may take it

    def write(self, record: dict, expected) -> bool:
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)
        return True

    def delete(self, expected) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


class _GCS:
    """A gs:// object; every write is conditional on the generation last seen (0: must not exist)."""

    def __init__(self, path: str):
        from maxlite.data.stage import _client

        bucket, name = path[len("gs://"):].split("/", 1)
        self.blob_of = lambda: _client().bucket(bucket).blob(name)
        self.generation = None

    @contextlib.contextmanager
    def locked(self):
        yield  # the preconditions are the lock

    def read(self) -> tuple[dict | None, Any]:
        from google.api_core import exceptions

        blob = self.blob_of()
        try:
            data = blob.download_as_bytes()
        except exceptions.NotFound:
            return None, 0
        try:
            return json.loads(data), blob.generation
        except ValueError:
            return {}, blob.generation

    def write(self, record: dict, expected) -> bool:
        from google.api_core import exceptions

        blob = self.blob_of()
        try:
            blob.upload_from_string(json.dumps(record), content_type="application/json",
                                    if_generation_match=expected)
        except exceptions.PreconditionFailed:
            return False
        self.generation = blob.generation
        return True

    def delete(self, expected) -> None:
        from google.api_core import exceptions

        with contextlib.suppress(exceptions.NotFound, exceptions.PreconditionFailed):
            self.blob_of().delete(if_generation_match=expected)


class Lease:
    """`acquire()` before anything is written; `lost` (a line, or None) as the run goes on;
    `release()` at the end."""

    def __init__(self, run_dir: str, me: Holder, timeout: float, log: Callable[[str], None] = print,
                 now: Callable[[], float] = time.time):
        self.path, self.me, self.timeout, self.log, self.now = f"{run_dir}/{FILE}", me, timeout, log, now
        self.store = _GCS(self.path) if run_dir.startswith("gs://") else _Local(self.path)
        self.lost: str | None = None
        self.took_over: dict | None = None  # the holder this launch replaced
        self._mine = None  # what the store says our lease is (gs://: its generation)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Hold the lease, or raise TransientError naming its holder (a live writer passes: wait, or
        run again)."""
        if "://" not in self.path:
            make_dir(os.path.dirname(self.path))
        with self.store.locked():
            held, generation = self.store.read()
            now = self.now()
            if held is not None:
                why = takeover_reason(held, self.me, self.timeout, now) if held else "its file is unreadable"
                if why is None:
                    raise TransientError(f"run directory {os.path.dirname(self.path)} is in use by "
                                        f"{describe(held, now)}: one writer per run; stop it, wait "
                                        f"{self.timeout:g} s after it is gone, or pick another run_name")
                self.took_over = {**held, "why": why}
            if not self.store.write(self.me.record(now), generation if held is not None else 0):
                raise TransientError(f"run directory {os.path.dirname(self.path)}: another launch took the "
                                     f"lease at the same moment; one writer per run: run again")
            self._mine = getattr(self.store, "generation", None)
        if self.took_over:
            self.log(f"maxlite: took over the run's lease from {describe(self.took_over, now)}: "
                     f"{self.took_over['why']}")
        self._thread = threading.Thread(target=self._beat, name="maxlite-lease", daemon=True)
        self._thread.start()

    def heartbeat(self) -> bool:
        """Renew the lease if it is still ours; False (and `lost` says why) once it is not."""
        with self.store.locked():
            held, generation = self.store.read()
            if not held or held.get("token") != self.me.token:
                self.lost = f"the run was taken over by {describe(held, self.now())}" if held else \
                    "its lease file is gone"
                return False
            expected = self._mine if self._mine is not None else generation
            if not self.store.write(self.me.record(self.now()), expected):
                self.lost = "another launch rewrote the lease"
                return False
            self._mine = getattr(self.store, "generation", None)
        return True

    def _beat(self) -> None:
        while not self._stop.wait(max(self.timeout / 4, 0.5)):
            try:
                if not self.heartbeat():
                    self.log(f"maxlite: error: lost the run's lease: {self.lost}; stopping without writing more")
                    return
            except Exception as e:  # noqa: BLE001 — a storage hiccup: the next beat tries again
                self.log(f"maxlite: warning: lease heartbeat failed ({type(e).__name__}); retrying")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost is not None:
            return  # someone else's now
        with contextlib.suppress(Exception), self.store.locked():
            held, generation = self.store.read()
            if held and held.get("token") == self.me.token:
                self.store.delete(self._mine if self._mine is not None else generation)


def job_identity() -> tuple[str, str]:
    """(the job, the launcher in words) of this trainer, from the environment a launcher sets: in a
    Slurm job, a requeued attempt of the same job takes the run's lease over from its predecessor;
    outside one, a plain launch."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return "", "python -m maxlite.train"
    return f"slurm:{job_id}", f"Slurm job {job_id} attempt {os.environ.get('SLURM_RESTART_COUNT', '0')}"
