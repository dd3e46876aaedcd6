"""Checkpointing inside the training loop; storage, listing and the bridge API are in `maxlite.checkpoints`."""

from maxlite.checkpointing.manager import Checkpointer, initial_state

__all__ = ["Checkpointer", "initial_state"]
