"""Work done, for the hang watchdog to tell a slow process from a hung one: the CPU seconds this
process has used (every thread: compiling, computing, writing a checkpoint) plus those its peers
have used, as each last published them through jax.distributed's key-value store (from `share()`
on: after jax.distributed is connected — a key-value call before that aborts the process). A
process that waits on a slow peer sees the peer's work; a truly stuck job does none.
"""

from __future__ import annotations

import sys
import time

PREFIX = "maxlite/progress/"
PUBLISH_SECONDS = 2.0  # each process publishes its work, and reads the peers', this often
# A peer's work is seen up to 2 × PUBLISH_SECONDS late (its publication, then our read): a span
# shorter than this one can miss a peer that works all through it.
SPAN_SECONDS = 3 * PUBLISH_SECONDS


def _client():
    """jax.distributed's client when this job has several processes, else None."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    try:
        from jax._src import distributed
        client = distributed.global_state.client
        return client if client is not None and jax.process_count() > 1 else None
    except Exception:  # noqa: BLE001 — before initialisation, or a jax without it: own work only
        return None


class Progress:
    """`progress()` → CPU seconds of work by this process and its peers (monotone per source)."""

    def __init__(self, clock=time.monotonic, own=time.process_time, log=None):
        """`log(line)`: where the one warning goes when the peers' figures cannot be read."""
        self.clock, self.own, self.client = clock, own, lambda: None
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._published = None
        self._peers = 0.0
        self.stale: str | None = None  # why the peers' work is no longer read fresh, once said

    def share(self) -> None:
        """Publish and read the peers' work from now on (call once jax.distributed is connected)."""
        self.client = _client

    def __call__(self) -> float:
        own = self.own()
        client = self.client()
        if client is None:
            return own
        now = self.clock()
        if self._published is None or now - self._published >= PUBLISH_SECONDS:
            self._published = now
            try:
                from jax import process_index
                client.key_value_set(f"{PREFIX}{process_index()}", f"{own:.3f}", allow_overwrite=True)
                self._peers = sum(float(v) for k, v in client.key_value_dir_get(PREFIX)
                                  if k.rsplit("/", 1)[-1] != str(process_index()))
            except Exception as e:  # noqa: BLE001 — the coordinator gone: the peers' last figures stand
                if self.stale is None:
                    self.stale = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                    self.log(f"maxlite: warning: cannot read the peers' progress from jax.distributed's "
                             f"key-value store ({self.stale[:200]}); the hang watchdog judges on this process's "
                             f"work and the peers' last figures (said once)")
        return own + self._peers
