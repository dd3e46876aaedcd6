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

    def __init__(self, clock=time.monotonic, own=time.process_time):
        self.clock, self.own, self.client = clock, own, lambda: None
        self._published = None
        self._peers = 0.0

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
            except Exception:  # noqa: BLE001 — the coordinator gone: judge on own work
                pass
        return own + self._peers
