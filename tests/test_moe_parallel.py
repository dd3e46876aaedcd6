"""maxlite/models/moe_parallel.py: expert parallelism on 8 simulated CPU devices (expert 4 × fsdp 2)
trains like one device: the experts split over `expert`, each device's tokens sent to their experts
by all-to-all and back, dropless (ragged) and with fixed capacity buffers (capacity). Same losses
over two steps, relative 1e-5 (float32: only the order of sums differs), and the same weights
after them."""

import jax
import numpy as np
import pytest

from helpers import train_losses

MOE = ["base.yml", "model_name=tiny-moe", "base_emb_dim=32", "base_moe_mlp_dim=16", "base_mlp_dim=32",
       "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=16", "base_num_decoder_layers=2",
       "vocab_size=128", "max_target_length=16", "num_experts=8", "num_experts_per_tok=2", "dtype=float32",
       "enable_tensorboard=false", "write_report=false", "learning_rate=1e-2", "load_balance_loss_weight=0.1"]


@pytest.mark.parametrize("impl", ["ragged", "capacity"])
def test_expert_parallel_training_equals_one_device(impl):
    extra = [f"moe_implementation={impl}"] + (["capacity_factor=1.0"] if impl == "capacity" else [])
    one, state_one = train_losses(MOE + extra + ["per_device_batch_size=8", "ici_fsdp_parallelism=1"], 1, 2)
    ep, state_ep = train_losses(MOE + extra + ["per_device_batch_size=1", "ici_expert_parallelism=4",
                                               "ici_fsdp_parallelism=2"], 8, 2)
    np.testing.assert_allclose(ep, one, rtol=1e-5)
    assert one[1] != one[0]  # it trained: the loss moved
    for a, b in zip(jax.tree.leaves(state_ep.params), jax.tree.leaves(state_one.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
