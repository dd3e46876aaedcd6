"""A splash-attention mask whose query rows are in any order (the balanced layout of context
parallelism, maxlite/models/context.py): causal, or a sliding window, by sequence position.
Its own module because it subclasses a Pallas class, imported only where splash runs."""

from __future__ import annotations

import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm


class OrderedMask(sm._ComputableMask):  # splash's CausalMask and LocalMask are built the same way
    """Query row r sits at sequence position order[r]; key column j at position j. Key j is visible
    to row r iff j ≤ order[r] (and order[r] − j < window when window > 0). The kernel evaluates the
    rule itself on the rows' positions (`q_sequence`), so no [T, T] mask is ever stored."""

    def __init__(self, order: np.ndarray, window: int = 0):
        def rule(q_ids, kv_ids):
            ok = q_ids >= kv_ids
            return ok if not window else ok & (q_ids - kv_ids < window)

        super().__init__((len(order), len(order)), rule)
        self.q_sequence = np.asarray(order, np.int32)
        self.window = window

    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and self.window == other.window
                and np.array_equal(self.q_sequence, other.q_sequence))

    def __hash__(self) -> int:
        return hash((type(self), self.window, self.q_sequence.tobytes()))
