"""Checkpointing inside the training loop; storage, listing and the bridge API are in `maxlite.checkpoints`."""

from maxlite.checkpointing.manager import Checkpointer

__all__ = ["Checkpointer"]
