"""A train iterator an objective may read ahead of the loop (asynchronous RL samples the prompts of
steps t+1..t+k while step t trains), whose saved position is still the loop's: `get_state()` is the
state before the oldest batch read ahead and not yet taken, so a checkpoint at step t resumes at
batch t whatever was peeked; `set_state` (resume, rollback) drops what was read ahead."""

from __future__ import annotations

import collections


class Lookahead:
    def __init__(self, iterator):
        self._it = iterator
        self._ahead: collections.deque = collections.deque()  # (state before the batch, the batch)

    def __iter__(self):
        return self

    def __next__(self):
        if self._ahead:
            return self._ahead.popleft()[1]
        return next(self._it)

    def peek(self, i: int):
        """The i-th batch after those the loop took (0: the next one); None past the data's end."""
        while len(self._ahead) <= i:
            state = self._it.get_state()
            try:
                self._ahead.append((state, next(self._it)))
            except StopIteration:
                return None
        return self._ahead[i][1]

    def get_state(self):
        return self._ahead[0][0] if self._ahead else self._it.get_state()

    def set_state(self, state) -> None:
        self._ahead.clear()
        self._it.set_state(state)

    @property
    def batches_read(self) -> int:
        """The batches the loop took (rollback's count of the data a segment read)."""
        return self._it.batches_read - len(self._ahead)

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close:
            close()
