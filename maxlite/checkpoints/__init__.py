"""Orbax checkpoints, local or gs://, in one package split by responsibility:

    storage.py   paths' storage, its one-line errors and access checks
    layout.py    the on-disk format: items, complete vs incomplete steps, the Orbax manager
    restore.py   items of a step restored onto any mesh, checked against their checksums; another
                 model's checkpoint is one line
    checksums.py, crc.py  the checksums every save writes and every restore checks; corrupt markers
    saver.py     the loop's Checkpointer: its schedule, async saves (offload.py), failures
    params.py    parameters in and out for the PyTorch bridge and Python users
    listing.py   `python -m maxlite.checkpoints list PATH` and `verify PATH [STEP]`

Where a run starts from (its checkpoint, a snapshot, another run) is decided in `maxlite.resume`.
"""

from maxlite.checkpoints import checksums
from maxlite.checkpoints.checksums import CheckpointCorrupt
from maxlite.checkpoints.layout import (ITEMS, TMP_STEP, clean_leftovers,
                                        manager_options, maxlite_version, open_manager, read_meta,
                                        remove_failed_save, resolve_step_dir, array_save,
                                        temporary_path_with_hook)
from maxlite.checkpoints.listing import checkpoint_name, list_checkpoints, main
from maxlite.checkpoints.params import load_numpy, load_params, save_params
from maxlite.checkpoints.restore import check_compatible, restore_items, sharded_target
from maxlite.checkpoints.storage import (check_bucket, check_path, check_room, check_storage, checkpoint_dir,
                                         complete_steps, error_line, fs_of, storage_error)

__all__ = ["CheckpointCorrupt", "ITEMS", "TMP_STEP", "array_save", "check_bucket", "check_compatible", "check_path",
           "check_room", "check_storage", "checkpoint_dir", "checkpoint_name", "checksums", "clean_leftovers",
           "complete_steps", "error_line", "fs_of", "list_checkpoints", "load_numpy", "load_params", "main", "manager_options",
           "maxlite_version", "open_manager", "read_meta", "remove_failed_save", "resolve_step_dir",
           "restore_items", "save_params", "sharded_target", "storage_error", "temporary_path_with_hook"]
