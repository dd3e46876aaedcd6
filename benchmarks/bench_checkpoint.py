"""Checkpoint speed against this disk's own raw write speed, measured in the same run.

    python benchmarks/bench_checkpoint.py [--dir /tmp/x] [--layers 4] [--repeats 3]

Writes benchmarks/results/checkpoint.json: save and restore GB/s, raw write+fsync GB/s of the same
byte count, and how long an async save blocks the loop against a synchronous save.
Targets (issue 4): save ≥ 70% of raw write speed; async blocking ≤ 10% of a sync save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from maxlite import config as C, mesh as mesh_lib, optim, state as state_lib  # noqa: E402
from maxlite.checkpointing import Checkpointer, initial_state  # noqa: E402


class _Data:
    def get_state(self):
        return {"step": 0}

    def set_state(self, state):
        pass


def raw_write_seconds(path: str, nbytes: int, fsync: bool = True, chunk: int = 64 << 20) -> float:
    """dd-like: write `nbytes` of incompressible bytes in 64 MiB chunks, then (optionally) fsync."""
    block = os.urandom(min(chunk, nbytes))
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    where = tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir)
    argv = ["base.yml", "model_name=tiny", "base_emb_dim=512", "base_mlp_dim=2048", "base_num_query_heads=8",
            "base_num_kv_heads=8", "head_dim=64", f"base_num_decoder_layers={args.layers}",
            f"base_output_directory={where}", "run_name=bench", "max_num_checkpoints_to_keep=0"]
    cfg = C.resolve(C.load(argv), jax.device_count())
    mesh = mesh_lib.make_mesh(cfg)
    tx = optim.make_optimizer(cfg)
    _, abstract, shardings = state_lib.abstract_state(cfg, mesh, tx)
    state = state_lib.create_state(cfg, mesh, tx, shardings)
    jax.block_until_ready(state)
    nbytes = state_lib.nbytes(abstract)
    print(f"state: {nbytes / 2**20:,.1f} MiB on {jax.device_count()} devices → {where}", flush=True)

    raw, raw_cached, sync_s, synced_s, async_block, async_total, restore_s = [], [], [], [], [], [], []
    step = 0
    for r in range(args.repeats):
        raw.append(raw_write_seconds(f"{where}/raw.bin", nbytes))
        raw_cached.append(raw_write_seconds(f"{where}/raw.bin", nbytes, fsync=False))
        for mode, out in (("false", sync_s), ("true", async_block)):
            c = C.load([*argv, f"async_checkpointing={mode}"])
            c = C.resolve(c, jax.device_count())
            ck = Checkpointer(c, True, nbytes)
            step += 1
            start = time.perf_counter()
            ck.save(step, state, _Data())
            blocked = time.perf_counter() - start
            ck.poll(wait=True)
            total = time.perf_counter() - start
            if mode == "false":
                out.append(total)
                os.sync()  # Orbax leaves the data in the page cache: time the flush to compare with fsync
                synced_s.append(time.perf_counter() - start)
            else:
                out.append(blocked)
                async_total.append(total)
            ck.close()
        ck = Checkpointer(cfg, True, nbytes)
        start = time.perf_counter()
        restored = initial_state(cfg, ck, mesh, tx, abstract, shardings, _Data(), 0, False)
        jax.block_until_ready(restored)
        restore_s.append(time.perf_counter() - start)
        ck.close()
        del restored
        print(f"repeat {r + 1}: raw {raw[-1]:.2f} s, sync save {sync_s[-1]:.2f} s, async blocks "
              f"{async_block[-1]:.3f} s (done in {async_total[-1]:.2f} s), restore {restore_s[-1]:.2f} s",
              flush=True)

    med = statistics.median
    gb = nbytes / 1e9
    result = {
        "state_bytes": nbytes, "devices": jax.device_count(), "repeats": args.repeats,
        "load_average_1min": os.getloadavg()[0], "cpu_count": os.cpu_count(), "dir": where,
        "raw_write_fsync_gb_per_s": gb / med(raw),
        "raw_write_no_fsync_gb_per_s": gb / med(raw_cached),
        "sync_save_gb_per_s": gb / med(sync_s),
        "sync_save_then_os_sync_gb_per_s": gb / med(synced_s),
        "async_save_total_gb_per_s": gb / med(async_total),
        "restore_gb_per_s": gb / med(restore_s),
        "save_vs_raw_write": med(raw_cached) / med(sync_s),  # both into the page cache
        "save_synced_vs_raw_write_fsync": med(raw) / med(synced_s),  # both flushed to disk
        "async_block_seconds": med(async_block),
        "sync_save_seconds": med(sync_s),
        "async_block_vs_sync_save": med(async_block) / med(sync_s),
        "targets": {"save_vs_raw_write": ">= 0.70", "save_synced_vs_raw_write_fsync": ">= 0.70", "async_block_vs_sync_save": "<= 0.10"},
        "samples": {"raw_s": raw, "raw_no_fsync_s": raw_cached, "sync_save_s": sync_s,
                    "sync_save_then_os_sync_s": synced_s, "async_block_s": async_block,
                    "async_total_s": async_total, "restore_s": restore_s},
    }
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "checkpoint.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    shutil.rmtree(where, ignore_errors=True)


if __name__ == "__main__":
    main()
