"""The decode "cache" of Gemma 4's key/value-sharing layers: none of their own (maxlite/models/gemma4_cache.py)."""

from maxlite.models.gemma4_cache import BATCH_AXES, CONTEXT, empty_shared as empty, step_shared as step  # noqa: F401


def advance(pos_BS, positions_BT, lengths_B):
    return pos_BS  # no slots to record
