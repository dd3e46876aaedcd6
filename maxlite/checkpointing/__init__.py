"""Checkpointing inside the training loop (manager.py) and the `list` CLI (listing.py); storage and the
bridge API are in `maxlite.checkpoints`."""

from maxlite.checkpointing.manager import Checkpointer, initial_state

__all__ = ["Checkpointer", "initial_state"]
