"""The rules every attention implementation shares: which keys a query sees, and the default scale."""

from __future__ import annotations

import math


def scale_or_default(H: int, scale: float | None) -> float:
    """The scores' scale: `scale` when given (Gemma's query_pre_attn_scalar^-½), else 1/√H."""
    return 1.0 / math.sqrt(H) if scale is None else scale


def visible(q_idx, k_idx, window: int, chunk: int = 0):
    """Causal, and within the window when there is one (indices of one row, any broadcast shape); with
    `chunk` C > 0 (a chunked-attention layer: Llama 4's) also within the query's own chunk of C positions
    (q // C == k // C, Hugging Face's chunked mask), which holds only keys less than C back."""
    ok = q_idx >= k_idx
    if chunk:
        ok = ok & (q_idx // chunk == k_idx // chunk)
    return ok if not window else ok & (q_idx - k_idx < window)


def visible_in_blocks(q_idx, k_idx, window: int, qblock, kblock):
    """`visible`, and besides every key of the query's own image block (Gemma 3: the tokens of one
    image see each other both ways; block ids ≥ 0, −1 outside any). The window still applies, as
    transformers' sliding mask is AND(window, OR(causal, block)); a later key is always within it."""
    both = (qblock == kblock) & (qblock >= 0)
    ok = (q_idx >= k_idx) | both
    return ok if not window else ok & (q_idx - k_idx < window)
