"""Periodic evaluation: the same `eval_steps` batches of the eval split every time → loss, perplexity."""

from __future__ import annotations

import math


class Evaluator:
    def __init__(self, cfg, graphdef, params_shardings, batch_sharding, process_index: int,
                 process_count: int):
        from maxlite.step import jit_eval_step

        self.cfg, self.batch_sharding = cfg, batch_sharding
        self.where = (process_index, process_count)
        self.step_fn = jit_eval_step(graphdef, params_shardings, batch_sharding)

    def due(self, step: int) -> bool:
        return self.cfg.eval_interval > 0 and step % self.cfg.eval_interval == 0

    def run(self, params) -> dict[str, float]:
        """Token-weighted mean loss over the eval batches; one host read at the end."""
        import jax

        from maxlite import data

        # A fresh iterator each time: every eval sees the very same batches, so values compare.
        batches = data.make_iterator(self.cfg, "eval", *self.where)
        loss_sum = weights = 0.0
        count = 0
        try:
            for _ in range(self.cfg.eval_steps):
                try:
                    local = next(batches)
                except StopIteration:  # a small eval set: fewer batches than eval_steps
                    break
                batch = {k: jax.make_array_from_process_local_data(self.batch_sharding, v)
                         for k, v in local.items()}
                out = self.step_fn(params, batch)
                loss_sum, weights = loss_sum + out["loss_sum"], weights + out["total_weights"]
                count += 1
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        if count == 0:
            raise ValueError("the eval split gave no batch: check eval_dataset_path / eval_data_prefix")
        loss_sum, weights = float(loss_sum), float(weights)
        loss = loss_sum / max(weights, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": weights, "batches": count}
