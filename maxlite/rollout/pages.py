"""The host's book of the paged cache's blocks (maxlite/models/paged_cache.py): a free list,
a reference count per block, each slot's block table, and what a started sequence may still take.

Prefix sharing: a prompt's full blocks (len // C of them) are written once, when its first
completion starts, and referenced by each of its G completions (+1 each) and by the prompt until
its last completion has started (+1), so a completion that starts after its siblings ended still
finds them; the prompt's partial last block is copied into each completion's own block, where its
tokens go on. A completion's own blocks are taken as it grows (one when it writes the first
position of a block) and all its references dropped when it ends.

Admission never over-commits: a sequence starts only if the free blocks, less those promised to
the started sequences' growth, hold its worst case (prompt + max_new_tokens), so no step ever finds
the pool empty and nothing is preempted. Block 0 is the null block: never handed out, the table
entry of every position not (yet) held, so an idle slot's row reads nothing of anyone's.
"""

from __future__ import annotations

import numpy as np


def blocks_for(tokens: int, C: int) -> int:
    return -(-tokens // C)


class Pages:
    def __init__(self, num_blocks: int, slots: int, width: int, block_size: int, share_prefix: bool = True):
        self.C, self.share = block_size, share_prefix
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks - 1, 0, -1))
        self.refs = np.zeros(num_blocks, np.int64)
        self.table = np.zeros((slots, width), np.int32)
        self.pos = np.zeros(slots, np.int64)  # the next position each slot writes
        self.left = np.zeros(slots, np.int64)  # blocks each slot may still take
        self.promised = 0
        self.prompts: dict = {}  # prompt index → its shared full blocks (while referenced by the prompt)
        self.peak = 0
        self.copies: list = []  # (prefill row, table column, block) to write at the next insert

    def in_use(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def _take(self) -> int:
        block = self.free.pop()
        assert self.refs[block] == 0
        self.refs[block] = 1
        self.peak = max(self.peak, self.in_use())
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        assert self.refs[block] >= 0
        if self.refs[block] == 0:
            self.free.append(block)

    def _shared(self, length: int) -> int:
        return length // self.C if self.share else 0

    def need(self, p: int, length: int, max_new: int) -> int:
        """Blocks a completion of prompt p (of `length` tokens) may take, worst case."""
        own = blocks_for(length + max_new, self.C) - self._shared(length)
        return own + (0 if p in self.prompts else self._shared(length))

    def admits(self, p: int, length: int, max_new: int) -> bool:
        return len(self.free) - self.promised >= self.need(p, length, max_new)

    def start(self, slot: int, p: int, g: int, generations: int, row: int, length: int, max_new: int) -> None:
        """Slot `slot` starts completion g of prompt p (row `row` of the last prefill)."""
        assert self.admits(p, length, max_new)
        full = self._shared(length)
        if p not in self.prompts:  # its full blocks: written once, held by the prompt
            self.prompts[p] = [self._take() for _ in range(full)]
            self.copies += [(row, m, b) for m, b in enumerate(self.prompts[p])]
        shared = self.prompts[p]
        for b in shared:
            self.refs[b] += 1
        if g == generations - 1:  # the last completion started: the prompt lets go
            for b in self.prompts.pop(p):
                self._drop(b)
        self.table[slot] = 0
        self.table[slot, :full] = shared
        self.left[slot] = blocks_for(length + max_new, self.C) - full
        self.promised += self.left[slot]
        for m in range(full, blocks_for(length, self.C)):  # the partial last block (all, unshared): copied
            self.table[slot, m] = self._own(slot)
            self.copies.append((row, m, self.table[slot, m]))
        self.pos[slot] = length

    def _own(self, slot: int) -> int:
        assert self.left[slot] > 0, "a sequence outgrew its reservation"
        self.left[slot] -= 1
        self.promised -= 1
        return self._take()

    def grow(self, slots) -> None:
        """The slots `slots` write their next position now: a block for each that starts one."""
        for s in slots:
            m = self.pos[s] // self.C
            if m < self.table.shape[1] and self.table[s, m] == 0:
                self.table[s, m] = self._own(s)
            self.pos[s] += 1

    def release(self, slot: int) -> None:
        """The sequence in `slot` ended: drop its references and its unused promise."""
        for b in self.table[slot][self.table[slot] > 0]:
            self._drop(int(b))
        self.table[slot] = 0
        self.promised -= self.left[slot]
        self.left[slot] = 0

    def narrow(self, rows: np.ndarray) -> None:
        """The slots become `rows` of the old ones (the engine's narrower tail batch)."""
        self.table, self.pos, self.left = self.table[rows], self.pos[rows], self.left[rows]

    def take_copies(self) -> list:
        copies, self.copies = self.copies, []
        return copies
