"""Multi-token prediction (DeepSeek-V3; `mtp_num_layers`, `mtp_loss_scaling_factor`): the training
loss of the extra depths (transformer.MTPLayer), which decoding never runs.

Depth k = 1 … D at position i reads the previous depth's hidden state there (depth 0: the main
model's final-normed output) and the embedding of token i + k (the model's own table), and predicts
token i + k + 1 through the model's output head. A position counts only where that target is in
the same document as position i (packed rows: no prediction across a boundary, nor past the row's
end) and carries loss weight (SFT's mask, padding 0): the target's own weight. Each depth's loss is
its weighted mean cross-entropy; `mtp_loss` is their mean, added to the objective × the scaling
factor (the paper's λ/D · Σ_k L_k).

Shape legend as in layers.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _ahead(x_BT, k: int, fill=0):
    """x[:, i + k] at position i (`fill` past the row's end)."""
    return jnp.concatenate([x_BT[:, k:], jnp.full((x_BT.shape[0], k), fill, x_BT.dtype)], axis=1)


def loss(model, x_BTD, batch) -> tuple[jax.Array, dict | None]:
    """(mtp_loss: the mean over depths of each depth's weighted mean cross-entropy, the routing
    statistics of the depths' MoE layers stacked [D, ...] or None): a MoE model's depths route as
    its layers do, so their load joins the balance losses and the routing-bias update."""
    inputs, targets, seg = batch["inputs"], batch["targets"], batch["segment_ids"]
    h_BTD, losses, stats = x_BTD, [], []
    for k, layer in enumerate(model.mtp, start=1):
        # the target of depth k at i is token i + k + 1: targets[i + k]; its weight counts it
        weights_BT = _ahead(batch["weights"], k) * (_ahead(seg, k, -1) == seg)
        h_BTD, normed_BTD, routing = layer(h_BTD, model.embed(_ahead(inputs, k), batch["positions"]),
                                           batch["positions"], seg)
        stats += [] if routing is None else [routing]
        logits_BTV = model.logits(normed_BTD)
        target_logit_BT = jnp.take_along_axis(logits_BTV, _ahead(targets, k)[..., None], axis=-1)[..., 0]
        xent_BT = jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit_BT
        losses.append(jnp.sum(xent_BT * weights_BT) / jnp.maximum(jnp.sum(weights_BT), 1.0))
    return sum(losses) / len(losses), (jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None)
