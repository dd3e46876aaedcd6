"""A decode step's cache work (maxlite/models/cache_read.py, gqa_cache.step_in_stack): the blockwise
read of the filled slots equals attending the whole cache, reads no block past the filled slots, and
the compiled decode loop keeps no copy of the cache beside the cache itself."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxlite import api, config as C
from maxlite.models import cache_read, decode, gqa_cache
from tests.helpers import SMALL

B, S, K, G, H = 3, 13, 2, 2, 8
LENS = np.array([5, 9, 3])  # each row's tokens before the step


def _record(lens, window: int):
    """Each slot's position (−1 empty) after `lens` tokens: slot s of a ring of S holds the newest p ≡ s."""
    pos = np.full((B, S), -1, np.int32)
    for b, n in enumerate(lens):
        for p in range(max(0, n - S) if window else 0, n):
            pos[b, p % S] = p
    return jnp.asarray(pos)


@pytest.mark.parametrize("window, T, sinks", [(0, 1, False), (0, 2, True), (S, 1, True)],
                         ids=["global", "global-two-tokens-sinks", "ring-sinks"])
def test_the_blockwise_read_equals_attending_the_whole_cache_and_skips_unfilled_blocks(window, T, sinks):
    lens = LENS + (10 if window else 0)  # a ring's rows wrap around
    keys = jax.random.split(jax.random.key(0), 6)
    q_BTNH = jax.random.normal(keys[0], (B, T, K * G, H))
    k_LBSKH, v_LBSKH = (jax.random.normal(k, (2, B, S, K, H)) for k in keys[1:3])
    new_k, new_v = (jax.random.normal(k, (B, T, K, H)) for k in keys[3:5])
    sinks_N = jax.random.normal(keys[5], (K * G,)) if sinks else None
    pos_BS = _record(lens, window)
    qpos_BT = jnp.asarray(lens)[:, None] + jnp.arange(T)
    lengths_B = jnp.asarray(lens) + T
    filled = min(int(lengths_B.max()), S)
    block = 4  # S = 13: the last block is shifted back over slots already read
    unread = -(-filled // block) * block  # blocks from here on are never read: poison them

    @jax.jit
    def both(k_LBSKH, v_LBSKH):
        slots_BT = gqa_cache._slots(qpos_BT, lengths_B, S)
        k_LBSKH, v_LBSKH = (gqa_cache._write_at(c, 1, n, slots_BT, c.dtype)
                            for c, n in ((k_LBSKH, new_k), (v_LBSKH, new_v)))
        k_poisoned, v_poisoned = (c.at[:, :, unread:].set(jnp.nan) for c in (k_LBSKH, v_LBSKH))
        got = cache_read.attend(q_BTNH, k_poisoned, v_poisoned, 1, pos_BS, qpos_BT, slots_BT, filled, window, 0.3,
                                sinks_N, block=block)
        want = gqa_cache._attend(q_BTNH, k_LBSKH[1], v_LBSKH[1], gqa_cache.advance(pos_BS, qpos_BT, lengths_B),
                                 qpos_BT, window, 0.3, sinks_N)
        return got, want
    got, want = both(k_LBSKH, v_LBSKH)
    assert (unread < S) == (not window) and np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_compiled_decode_loop_keeps_no_copy_of_the_cache(dtype):
    """Beside the cache itself (made inside the loop's program), the loop's temporaries do not grow
    with its length: the new keys are written where the cache lies and the read copies blocks (twice
    the length: less than one layer's keys more). In bfloat16 too, which XLA:CPU updates through a
    float32 copy of the whole stack unless the stack holds its bits (maxlite/models/cache_bits.py;
    without: 2.6 MB more beside the cache at 4,096 positions than at 2,048)."""
    beside, layer = {}, {}
    for length in (2048, 4096):
        cfg = C.load([*SMALL, f"max_target_length={length}", f"dtype={dtype}"])
        graphdef, params = nnx.split(api.create_model(cfg, seed=0), nnx.Param)
        fn = jax.jit(functools.partial(decode.generate_tokens, graphdef, max_new_tokens=length - 8, temperature=0.0,
                                       top_k=0, top_p=1.0, eos_id=-1))
        compiled = fn.lower(params, jnp.ones((1, 8), jnp.int32), jnp.array([8]), jax.random.key(0)).compile()
        (kv, _), = decode.empty_cache(cfg, 1, length).stacks.values()
        beside[length] = compiled.memory_analysis().temp_size_in_bytes - sum(a.nbytes for a in kv)
        layer[length] = kv.k_LBSKH[0].nbytes
    assert beside[4096] - beside[2048] < layer[2048]


@pytest.mark.parametrize("preset", ["qwen3.5-27b", "kimi-linear-48b-a3b", "nemotron-h-8b", "deepseek-v3"])
def test_a_recurrent_kinds_cache_is_the_same_at_any_length_and_the_others_grow(preset):
    """Each mixer kind's `recurrent` declaration, held against the arrays decoding allocates: the stacks
    of a recurrent kind (delta-net, Kimi delta attention, Mamba-2) hold the same bytes at 64 and 4096
    positions, every other stack more at 4096 (but a layer without a mixer, which keeps nothing);
    `decode_cache_numbers` counts exactly those bytes."""
    from maxlite.models.kinds import MIXERS, decode_cache_numbers
    from tests.helpers import shrunk

    cfg = C.load(shrunk(preset) + ["dtype=float32"])
    sizes = {}
    for length in (64, 4096):
        cache = jax.eval_shape(lambda: decode.empty_cache(cfg, 1, length))
        sizes[length] = {key: sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(layers))
                         for key, (layers, _) in cache.stacks.items()}
        total, state = decode_cache_numbers(cfg, length)
        assert (4 * total, 4 * state) == (sum(sizes[length].values()),
                                          sum(b for key, b in sizes[length].items() if MIXERS[key[0]].recurrent))
    assert any(MIXERS[mixer].recurrent for mixer, _ in sizes[64]) == (preset != "deepseek-v3")
    for key in sizes[64]:
        if key[0] == "none":
            assert sizes[64][key] == sizes[4096][key] == 0
        else:
            assert (sizes[64][key] == sizes[4096][key]) == MIXERS[key[0]].recurrent, key
