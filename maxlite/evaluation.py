"""Periodic evaluation: the same `eval_steps` batches of the eval split every time, scored by the
run's objective — token-weighted loss and perplexity (lm), DPO's figures against the reference,
GRPO's mean reward of greedy completions (maxlite/objectives/ supplies the scorer)."""

from __future__ import annotations

import math
from typing import Callable, Iterator


class Evaluator:
    def __init__(self, cfg, graphdef, params_shardings, batch_sharding, reader_index: int,
                 reader_count: int, score: Callable | None = None):
        """`score(params, opt_state, batches) → {name: float}`: the objective's (None: lm loss).
        `reader_index`/`reader_count`: the rows this process reads (maxlite/mesh.py readers)."""
        from maxlite.step import jit_eval_step

        self.cfg, self.batch_sharding = cfg, batch_sharding
        self.where = (reader_index, reader_count)
        self.step_fn = jit_eval_step(graphdef, params_shardings, batch_sharding)
        self.score = score or self._lm
        self._count = 0

    def due(self, step: int) -> bool:
        return self.cfg.eval_interval > 0 and step % self.cfg.eval_interval == 0

    def run(self, params, opt_state=None) -> dict[str, float]:
        """The objective's figures over the eval batches. `opt_state` holds an alignment run's
        reference policy."""
        from maxlite import data

        # A fresh iterator each time: every eval sees the very same batches, so values compare.
        batches = data.make_iterator(self.cfg, "eval", *self.where)
        try:
            values = self.score(params, opt_state, self._batches(batches))
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        if self._count == 0:
            raise ValueError("the eval split gave no batch: check eval_dataset_path / eval_data_prefix")
        return values

    def _batches(self, batches) -> Iterator[dict]:
        from maxlite.mesh import global_batch

        self._count = 0
        for _ in range(self.cfg.eval_steps):
            try:
                local = next(batches)
            except StopIteration:  # a small eval set: fewer batches than eval_steps
                break
            self._count += 1
            yield global_batch(local, self.batch_sharding)

    def _lm(self, params, opt_state, batches) -> dict[str, float]:
        """Token-weighted mean loss; one host read at the end."""
        loss_sum = weights = 0.0
        for batch in batches:
            out = self.step_fn(params, batch)
            loss_sum, weights = loss_sum + out["loss_sum"], weights + out["total_weights"]
        loss_sum, weights = float(loss_sum), float(weights)
        loss = loss_sum / max(weights, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": weights, "batches": self._count}
