"""DPO against a precomputed reference, `dpo_precompute_reference: true` (TRL's
`precompute_ref_log_probs`).

Before step 0 one pass computes the reference's log-probabilities of both sides of every pair of
the train and eval files with the weights the run starts from, and keeps them in a table keyed by
each pair's rows (data/preference.py `pair_key`), saved as `{run_dir}/dpo_reference.npz` (through
the run directory, maxlite/rundir.py) before the first checkpoint can exist. The optimizer state then holds no copy of the weights: the memory
of one model's trainable weights saved, for one forward per pair once. A resumed run loads the
table (its starting weights are gone); every step looks its pairs up on the host and hands the
values to the same DPO loss. A pair missing from the table (the data or max_target_length changed
since step 0) stops the run with one line.

Every process reads every record of the files (host work only), takes its share of each batch for
the sharded forward, and gets the whole result back, so each builds the same table.
"""

from __future__ import annotations

import io
import time
from typing import Iterator

import jax
import numpy as np

from maxlite import config as C
from maxlite.objectives import NO_CLOCK, Objective, dpo
from maxlite.rundir import print_primary

FILE = "dpo_reference.npz"
COLUMNS = tuple(f"ref_{side}_logps" for side in dpo.SIDES)
PROGRESS_SECONDS = 30.0


class Table:
    """pair key → the reference's log-probabilities of (chosen, rejected)."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        self.index = {str(k): i for i, k in enumerate(keys)}
        self.keys, self.values = np.asarray(keys), np.asarray(values, np.float32)

    def columns(self, keys: np.ndarray, path: str) -> dict[str, np.ndarray]:
        """{ref_chosen_logps, ref_rejected_logps} of the rows with `keys` (the table saved at `path`)."""
        try:
            rows = np.array([self.index[str(k)] for k in keys], np.int64)
        except KeyError:
            raise C.ConfigError(f"a pair is not in the precomputed reference table {path}: the data or "
                                f"max_target_length changed since step 0; start a fresh run (a new run_name)") from None
        return {name: self.values[rows, i] for i, name in enumerate(COLUMNS)}

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, keys=self.keys, values=self.values)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Table":
        saved = np.load(io.BytesIO(data))
        return cls(saved["keys"], saved["values"])


def _batches(rows: Iterator[dict], size: int) -> Iterator[tuple[list[str], dict[str, np.ndarray], int]]:
    """(keys, stacked rows padded to `size` with all-zero rows, real count)."""
    chunk = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield _stack(chunk, size)
            chunk = []
    if chunk:
        yield _stack(chunk, size)


def _stack(chunk: list[dict], size: int):
    keys = [str(r.pop("host_pair_key")) for r in chunk]
    out = {k: np.zeros((size, *v.shape), v.dtype) for k, v in chunk[0].items()}
    for i, r in enumerate(chunk):
        for k, v in r.items():
            out[k][i] = v
    return keys, out, len(chunk)


def compute(cfg, graphdef, params, batch_sharding, process_index: int, process_count: int,
            primary: bool) -> Table:
    """The reference table of the train and eval pairs under `params` (every process, collective)."""
    from maxlite.data import preference
    from maxlite.data.tokenizer import load_tokenizer
    from maxlite.mesh import replicated

    size = cfg.global_batch_size // cfg.gradient_accumulation_steps  # one micro-batch's rows per forward
    share = size // process_count
    forward = jax.jit(lambda p, rows: dpo.reference_logps(p, graphdef, rows),
                      in_shardings=(jax.tree.map(lambda x: x.sharding, params), batch_sharding),
                      out_shardings=replicated(batch_sharding.mesh))
    tok = load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
    splits = ["train"] + (["eval"] if cfg.eval_interval > 0 else [])
    keys, values, started, shown = [], [], time.perf_counter(), time.perf_counter()
    for split in splits:
        for batch_keys, rows, n in _batches(preference.every_pair(cfg, split, tok), size):
            local = {k: v[process_index * share:(process_index + 1) * share] for k, v in rows.items()}
            out = forward(params, {k: jax.make_array_from_process_local_data(batch_sharding, v)
                                   for k, v in local.items()})
            keys += batch_keys
            values.append(np.stack([np.asarray(out[c])[:n] for c in COLUMNS], axis=1))
            if time.perf_counter() - shown > PROGRESS_SECONDS:
                shown = time.perf_counter()
                print_primary(primary, f"maxlite: dpo reference: {len(keys)} pairs so far ({split})")
    print_primary(primary, f"maxlite: dpo reference: log-probabilities of {len(keys)} pairs "
                           f"({' + '.join(splits)}) in {time.perf_counter() - started:.1f}s")
    return Table(np.array(keys), np.concatenate(values))


def prepare(cfg, graphdef, state, step: int, batch_sharding, files, process_index: int, process_count: int,
            primary: bool) -> Table:
    """At step 0: compute the table from the starting weights and save it in the run directory
    `files` (maxlite.rundir.RunDir); later: load it from there."""
    if step == 0:
        table = compute(cfg, graphdef, state.params, batch_sharding, process_index, process_count, primary)
        files.write_file(FILE, table.to_bytes())  # the primary writes; a reader never sees half a table
        return table
    data = files.read_file(FILE)
    path = f"{files.path}/{FILE}"
    if data is None:
        raise C.ConfigError(f"dpo_precompute_reference: the run resumes at step {step} but {path} is "
                            f"missing, and the reference (the weights of step 0) is gone: start a fresh run")
    table = Table.from_bytes(data)
    print_primary(primary, f"maxlite: dpo reference: {len(table.keys)} pairs' log-probabilities from {path}")
    return table


class PrecomputedStep(Objective):
    """The DPO step and eval scorer reading the reference from the table (made by `restore`)."""

    def __init__(self, cfg, graphdef, tx, schedule, shardings, batch_sharding):
        from maxlite import step as step_lib

        self.cfg, self.graphdef, self.batch_sharding, self.table, self.path = cfg, graphdef, batch_sharding, None, ""
        super().__init__(step_lib.jit_step(cfg, graphdef, tx, schedule, shardings, batch_sharding, dpo.loss_fn(cfg)),
                         self.evaluate)
        self.score = dpo.eval_score(cfg, graphdef)

    def restore(self, state, step: int, files) -> None:
        """The table, once: computed at step 0 (collective), else loaded; a rollback keeps it (it
        holds the weights of step 0, whatever state the run rolls back to)."""
        if self.table is None:
            self.path = f"{files.path}/{FILE}"
            self.table = prepare(self.cfg, self.graphdef, state, step, self.batch_sharding, files,
                                 jax.process_index(), jax.process_count(), files.primary)

    def with_reference(self, batch: dict) -> dict:
        """The batch with its pairs' reference columns, sharded like its rows (host keys dropped)."""
        found = self.table.columns(batch["host_pair_key"], self.path)
        out = {k: v for k, v in batch.items() if not k.startswith("host_")}
        out.update({k: jax.make_array_from_process_local_data(self.batch_sharding, v) for k, v in found.items()})
        return out

    def __call__(self, state, batch, step: int, clock=NO_CLOCK):
        return super().__call__(state, self.with_reference(batch), step, clock)

    def evaluate(self, params, opt_state, batches) -> dict[str, float]:
        return self.score(params, opt_state, (self.with_reference(b) for b in batches))
