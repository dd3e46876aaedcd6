"""DeepSeek-V4's parts outside attention, each against transformers' own module with the same random
weights (float32): hyper-connections (maxlite/models/hyper.py: the collapse, spread and Sinkhorn mix
around a branch, and the head's collapse), and its MoE layer (√softplus scores with a choice bias,
clamped SwiGLU experts and shared expert; the hash-routed layer choosing experts by token id)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from maxlite import config as C

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def no_mesh():
    with nnx.use_eager_sharding(False):  # no mesh: the parameters' logical axes unused
        yield

D, N, E, F, K, V = 16, 3, 6, 8, 2, 32


def _hf_config():
    import transformers
    return transformers.DeepseekV4Config(
        hidden_size=D, num_hidden_layers=2, num_attention_heads=2, head_dim=16, q_lora_rank=8, vocab_size=V,
        hc_mult=N, hc_sinkhorn_iters=7, n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F,
        n_shared_experts=1, swiglu_limit=0.5, routed_scaling_factor=1.5, mlp_layer_types=["hash_moe", "moe"],
        layer_types=["sliding_attention", "sliding_attention"], index_n_heads=2, index_head_dim=8, o_groups=2,
        o_lora_rank=8)


def _cfg(*extra):
    return C.load(["base.yml", "model_name=deepseek-v4-flash", "dtype=float32", "weight_dtype=float32",
                   f"base_emb_dim={D}", "base_num_decoder_layers=2", f"hc_mult={N}", "hc_sinkhorn_iters=7",
                   f"num_experts={E}", f"num_experts_per_tok={K}", f"base_moe_mlp_dim={F}", f"base_mlp_dim={F}",
                   "mlp_activations_limit=0.5", "routed_scaling_factor=1.5", f"vocab_size={V}", "num_hash_layers=1",
                   "layer_types=[sliding_attention, sliding_attention]", "moe_implementation=dense", *extra])


def _randomized(module, seed: int):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return module


def _np(t):
    return t.detach().numpy()


def test_hyper_connection_around_a_branch_and_the_head_equal_transformers():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    from maxlite.models.hyper import HyperConnection, HyperHead

    cfg = _cfg()
    theirs = _randomized(m.DeepseekV4HyperConnection(_hf_config()), 0)
    ours = HyperConnection(cfg, rngs=nnx.Rngs(0))
    ours.fn[...], ours.base[...], ours.scale[...] = _np(theirs.fn).T, _np(theirs.base), _np(theirs.scale)
    x = torch.randn(2, 5, N, D)
    branch = torch.nn.Linear(D, D)  # any branch: what matters is what goes in and how it comes back
    post, comb, collapsed = theirs(x)
    want = post.unsqueeze(-1) * branch(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
    got_in, add = ours.collapse(jnp.asarray(_np(x)))
    np.testing.assert_allclose(np.asarray(got_in), _np(collapsed), rtol=1e-5, atol=1e-6)
    out = add(jnp.asarray(_np(branch(torch.from_numpy(np.array(got_in))))))
    np.testing.assert_allclose(np.asarray(out), _np(want), rtol=1e-5, atol=1e-5)
    # the mixing matrix is doubly stochastic: each row and column sums to 1 (Sinkhorn's point)
    _, _, mix = ours.weights(jnp.asarray(_np(x)))
    np.testing.assert_allclose(np.asarray(mix.sum(-1)), 1, atol=1e-3)
    np.testing.assert_allclose(np.asarray(mix.sum(-2)), 1, atol=1e-5)

    head_theirs = _randomized(m.DeepseekV4HyperHead(_hf_config()), 1)
    head = HyperHead(cfg, rngs=nnx.Rngs(0))
    head.fn[...], head.base[...], head.scale[...] = (_np(head_theirs.hc_fn).T, _np(head_theirs.hc_base),
                                                     _np(head_theirs.hc_scale))
    np.testing.assert_allclose(np.asarray(head(jnp.asarray(_np(x)))), _np(head_theirs(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layer", [0, 1], ids=["hash_routed", "top_k"])
def test_moe_layer_equals_transformers(layer):
    """Layer 0 is hash-routed (its experts: tid2eid of each token), layer 1 routes by the top k of
    √softplus(x·W) + bias; both weigh the chosen experts by their √softplus scores, renormalised ×
    1.5, with experts and shared expert clamped at 0.5."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    from maxlite.models.moe import MoE

    cfg = _cfg()
    theirs = _randomized(m.DeepseekV4SparseMoeBlock(_hf_config(), layer), 2 + layer)
    gate = theirs.gate
    with torch.no_grad():
        if layer == 0:
            gate.tid2eid.copy_(torch.stack([torch.randperm(E)[:K] for _ in range(V)]))
        else:
            gate.e_score_correction_bias.copy_(torch.randn(E))
    ours = MoE(cfg, rngs=nnx.Rngs(0), hashed=layer == 0)
    ours.router[...] = _np(gate.weight).T
    gate_up, down = _np(theirs.experts.gate_up_proj), _np(theirs.experts.down_proj)
    ours.gate[...], ours.up[...] = gate_up[:, :F].transpose(0, 2, 1), gate_up[:, F:].transpose(0, 2, 1)
    ours.down[...] = down.transpose(0, 2, 1)
    ours.shared.gate[...] = _np(theirs.shared_experts.gate_proj.weight).T
    ours.shared.up[...] = _np(theirs.shared_experts.up_proj.weight).T
    ours.shared.down[...] = _np(theirs.shared_experts.down_proj.weight).T
    if layer == 0:
        ours.tid2eid[...] = _np(gate.tid2eid).astype(np.float32)
    else:
        ours.router_bias[...] = _np(gate.e_score_correction_bias)
    ids = torch.randint(0, V, (2, 7))
    x = torch.randn(2, 7, D) * 2  # large enough for the clamps to act
    want = _np(theirs(x, input_ids=ids))
    got, _ = ours.routed(jnp.asarray(_np(x)), token_ids_BT=jnp.asarray(_np(ids)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
