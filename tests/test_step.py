import functools

import jax
import numpy as np
import pytest

from helpers import build, train_losses
from maxlite import config as C, optim

TINY = ["base.yml", "model_name=tiny", "dtype=float32", "max_target_length=32", "steps=20",
        "learning_rate=3e-3", "warmup_steps_fraction=0.1"]

# Reference losses of the first 3 steps of TINY on one device (float32, seed 0).
# Update them ONLY when a change is meant to alter the numerics (init, model maths, data, optimizer),
# say so in the commit message, and check that loss still falls; a refactor must leave them as they are.
GOLDEN = [8.360401, 8.369177, 8.305806]


@pytest.fixture(scope="module")
def one_device():
    """(batch, steps) -> (losses, final state) of TINY on one device with `batch` sequences per step:
    the reference runs several tests compare against, each trained once for the module (the tests
    only read them; released with the module)."""
    return functools.lru_cache(maxsize=None)(
        lambda batch, steps: train_losses(TINY + [f"per_device_batch_size={batch}"], 1, steps))


def test_golden_first_steps_loss(one_device):
    losses, _ = one_device(4, 3)
    np.testing.assert_allclose(losses, GOLDEN, rtol=2e-5, err_msg=(
        "the tiny model's first losses changed: fine only if this change was MEANT to alter the "
        "numerics (then update GOLDEN and say why in the commit); otherwise it is a regression"))


@pytest.mark.parametrize("mesh_args, devices", [
    (["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "per_device_batch_size=1"], 8),
    (["ici_data_parallelism=2", "ici_fsdp_parallelism=4", "per_device_batch_size=1"], 8),
])
def test_same_trajectory_on_other_meshes(mesh_args, devices, one_device):
    # the first 5 steps of the one-device run test_loss_falls_on_synthetic_data trains (the same
    # schedule: TINY's steps=20 sets it, not the number of steps run)
    reference = one_device(8, 20)[0][:5]
    losses, _ = train_losses(TINY + mesh_args, devices, 5)
    np.testing.assert_allclose(losses, reference, rtol=2e-4)


def test_parameter_and_optimizer_shardings():
    _, mesh, state, _, _ = build(TINY + ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"], 8)
    p = state.params
    spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    embed = ("fsdp", "context")  # the model dim over fsdp × context (context is 1 here)
    assert spec(p["layers"]["attn"]["q"][...]) == ("stage", embed, "tensor", None)  # [L, D, N, H]; L on the pipeline axis (1)
    assert spec(p["layers"]["attn"]["o"][...]) == ("stage", "tensor", None, embed)  # [L, N, H, D]
    assert spec(p["layers"]["mlp"]["down"][...]) == ("stage", "tensor", embed)  # [L, F, D]
    assert spec(p["embedding"][...]) == ("tensor", embed)  # [V, D]
    assert spec(p["unembedding"][...]) == (embed, "tensor")  # [D, V]
    assert spec(p["layers"]["attn_norm"]["scale"][...]) == ("stage", None)
    # Nothing whole on one device: the biggest matrix is split 8 ways.
    emb = p["embedding"][...]
    assert emb.addressable_shards[0].data.size == emb.size // 8
    # Adam moments follow the params; the step count is replicated.
    adam = state.opt_state[1][0]
    assert adam.mu["layers"]["attn"]["q"][...].sharding == p["layers"]["attn"]["q"][...].sharding
    assert adam.count.sharding.is_fully_replicated


def test_loss_falls_on_synthetic_data(one_device):
    losses, _ = one_device(8, 20)
    assert losses[-3:].mean() < losses[0] - 1.5, losses


@pytest.mark.parametrize("variant", [["remat_policy=none"], ["remat_policy=minimal"],
                                     ["remat_policy=save_dots"], ["scan_layers=false"],
                                     ["scan_layers=false", "remat_policy=none"]])
def test_scan_and_remat_variants_agree(variant, one_device):
    steps = 3
    reference, ref_state = one_device(4, steps)
    losses, state = train_losses(TINY + ["per_device_batch_size=4"] + variant, 1, steps)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    # The variants compute the same sums in another order, so their gradients agree to float32
    # rounding, and the weights to what Adam makes of it. Tolerances from that arithmetic, not from
    # one CPU's reduction order:
    # - per element: Adam's step moves an element by at most about lr_t (Kingma & Ba, sec. 2.1;
    #   b1=0.9, b2=0.95 here), whatever the gradient's size. Where an element's gradient cancels
    #   to its rounding noise, that noise picks Adam's direction, and the two runs may move it
    #   apart by up to 2 * lr_t per step (seen: one embedding element of 1,048,576 off by 2.5e-6,
    #   1e-3 relative, on AVX2 and on AVX-512 CPUs). So each element is within rtol 1e-4 of the
    #   reference plus 2 * sum(lr_t);
    # - per tensor, what holds the variants to the same result: a sum of K float32 terms carries
    #   a relative error of about sqrt(K) * eps (K: the longest reduction of the step, the vocabulary
    #   in the logits' backward), and Adam turns a relative gradient error into that fraction of
    #   lr_t; so the root-mean-square difference stays within sum(lr_t) * sqrt(K) * eps. A real
    #   difference (a layer not updated, layers swapped, another remat numerics) moves whole
    #   tensors by about lr_t, hundreds of times more.
    cfg = C.load(TINY)
    schedule = optim.learning_rate_schedule(cfg)
    moved = sum(float(schedule(t)) for t in range(steps))  # sum(lr_t): at most this far, per element
    longest = max(cfg.vocab_size, cfg.base_emb_dim, cfg.base_mlp_dim, 4 * cfg.max_target_length)  # batch 4
    rms_tol = moved * np.sqrt(longest) * np.finfo(np.float32).eps
    # and the weights they reach (unrolled layers are stored per layer: stack them to compare)
    def leaves(s):
        layers = s.params["layers"]
        stacked = (jax.tree.map(lambda *xs: np.stack(xs), *[layers[i] for i in range(len(layers))])
                   if "0" in dict(layers) or 0 in dict(layers) else layers)
        return jax.tree.leaves({"layers": stacked, "embedding": s.params["embedding"]})
    for got, want in zip(leaves(state), leaves(ref_state), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2 * moved)
        rms = float(np.sqrt(np.mean((got - want) ** 2)))
        assert rms <= rms_tol, f"{got.shape}: rms difference {rms:.2e} > {rms_tol:.2e}"


def test_gradient_accumulation_equals_the_big_batch(one_device):
    big, big_state = one_device(4, 3)
    acc, acc_state = train_losses(TINY + ["per_device_batch_size=1", "gradient_accumulation_steps=4"], 1, 3)
    np.testing.assert_allclose(acc, big, rtol=1e-5)
    # Summation order differs (micro-batch partial sums), so equal up to float32 rounding.
    np.testing.assert_allclose(acc_state.params["embedding"][...], big_state.params["embedding"][...],
                               atol=1e-5)


def test_batch_hash_sees_order_and_content_not_the_sharding():
    """The batch fingerprint the trainer logs: one value for one global batch however it is laid
    out on the devices; a swapped row pair or one changed token gives another."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from maxlite.step import batch_hash

    rng = np.random.default_rng(0)
    batch = {"inputs": rng.integers(0, 1000, (8, 16)).astype(np.int32),
             "segment_ids": np.ones((8, 16), np.int32), "weights": np.ones((8, 16), np.float32)}
    base = int(jax.jit(batch_hash)(batch))
    mesh = jax.make_mesh((8,), ("d",))
    sharded = {k: jax.device_put(v, NamedSharding(mesh, P("d"))) for k, v in batch.items()}
    assert int(jax.jit(batch_hash)(sharded)) == base
    swapped = {**batch, "inputs": batch["inputs"][[1, 0, *range(2, 8)]]}
    changed = {**batch, "inputs": batch["inputs"].copy()}
    changed["inputs"][5, 7] += 1
    assert int(jax.jit(batch_hash)(swapped)) != base
    assert int(jax.jit(batch_hash)(changed)) != base
