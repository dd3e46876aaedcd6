"""Mixtral and Qwen3-MoE built small and random by transformers (tests/hf_models.py): import → float32
logits equal transformers' (relative error ≤ 1e-5) and the auxiliary load-balancing loss equals the one
transformers returns with output_router_logits; greedy decoding identical to `generate`; export →
transformers loads it and computes the same logits. Qwen3-MoE keeps a dense first layer
(mlp_only_layers=[0]), stored apart from the scanned MoE layers."""

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from maxlite.bridge import hf
from maxlite.models import moe
from maxlite.state import abstract_params
from tests import hf_models
from tests.helpers import greedy_paths

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V, T = 256, 12


def _hf_model(family, path):
    """A random HF model (tests/hf_models.py), saved."""
    model = hf_models.model(family)
    model.save_pretrained(str(path))
    return model


def _ours(cfg, pure, ids):
    """(float32 logits, the auxiliary load-balancing loss) of maxlite's model."""
    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    B, T_ = ids.shape

    @nnx.jit
    def forward(m):
        x, stats = m.forward(ids, np.broadcast_to(np.arange(T_), (B, T_)), np.ones((B, T_), np.int32))
        return m.logits(x), moe.aux_losses(m.cfg, stats)["moe_lb_loss"]
    logits, lb = forward(model)
    return np.asarray(logits), float(lb)


def _relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_import_logits_aux_loss_greedy_and_export(family, tmp_path):
    model = _hf_model(family, tmp_path / "hf")
    cfg, pure = hf.import_hf(str(tmp_path / "hf"), ["max_target_length=32"])
    assert cfg.decoder_block == family and cfg.load_balance_loss_weight == 0.02
    assert cfg.first_num_dense_layers == (1 if family == "qwen3_moe" else 0)
    ids = np.random.default_rng(1).integers(0, V, (2, T))
    with torch.no_grad():
        out = model(torch.tensor(ids), output_router_logits=True)
    logits, lb = _ours(cfg, pure, ids)
    assert _relative(logits, out.logits.numpy()) <= 1e-5
    np.testing.assert_allclose(lb, float(out.aux_loss), rtol=1e-5)

    ours, theirs = greedy_paths(cfg, pure, model, list(range(10, 18)))
    assert ours == theirs and len(set(ours)) > 3, (ours, theirs)

    hf.export_hf(cfg, pure, str(tmp_path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(back) is type(model)
    assert sum(p.numel() for p in back.parameters()) == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        again = back(torch.tensor(ids)).logits.numpy()
    assert _relative(again, out.logits.numpy()) <= 1e-5
    jax.clear_caches()


def test_a_dense_layout_maxlite_cannot_express_is_refused():
    from maxlite.families.qwen3_moe import hf as qwen3_moe

    hf_cfg = hf_models.config("qwen3_moe").to_dict()
    hf_cfg.update(mlp_only_layers=[1])
    with pytest.raises(ValueError, match="mlp_only_layers"):
        qwen3_moe.config_overrides(hf_cfg)
