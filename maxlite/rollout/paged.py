"""The rollout engine over a paged (block) K/V cache (`rollout_paged_kv=true`): the continuous
engine's slots and host loop (maxlite/rollout/continuous.py), with grouped-query attention's and
MLA's caches held in a pool of `rollout_block_size`-position blocks (maxlite/models/paged_cache.py)
instead of a [max_length] row per slot. The host's block book (maxlite/rollout/pages.py) allocates
a sequence's blocks as it grows, frees them when it ends, and shares a prompt's full blocks among
its G completions; each step it passes the slots' block tables ([slots, M] int32) to the device.
The fixed-size caches (the delta-net's and Mamba-2's states: bytes per sequence, not per token)
stay per slot, copied in as the contiguous engine does. Gemma 4's K/V-sharing kinds are refused.

Four compiled functions with fixed shapes, as the contiguous engine's: `prefill` (the contiguous
prefill cache of Bp rows, P positions), `insert` (prompt blocks written into the pool, the
per-slot states copied, the slots' records set), `step` (every slot one token through the paged
read), `shrink` (the tail's narrower batch: the per-slot parts cut, the pool kept).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxlite.models import context, decode, paged_cache
from maxlite.models.layout import cache_groups, layer_kinds
from maxlite.rollout.continuous import ContinuousEngine, Slots
from maxlite.rollout.pages import Pages, blocks_for
from maxlite.rollout.sampling import Sampling
from maxlite.rollout.slots import copy_row, take_rows
from maxlite.schema import ConfigError


class _Compiled(NamedTuple):
    empty: object
    prefill: object
    insert: object
    step: object
    shrink: object


def _split(cache: decode.Cache):
    """(the paged stacks, the per-slot ones) of a cache, as two Caches."""
    paged = {k: v for k, v in cache.stacks.items() if k[0] in paged_cache.PAGED}
    return decode.Cache(paged), decode.Cache({k: v for k, v in cache.stacks.items() if k not in paged})


def _join(*caches: decode.Cache) -> decode.Cache:
    return decode.Cache({k: v for c in caches for k, v in c.stacks.items()})


def _compile(cfg, graphdef, slots: int, P: int, width: int, num_blocks: int, C: int, sampling: Sampling):
    """The paged engine's jitted functions for `slots` slots, tables of `width` blocks of C positions."""
    end_ids = jnp.asarray(sampling.end_ids() or (-1,), jnp.int32)
    D, length = cfg.base_emb_dim, P + sampling.max_new_tokens
    groups = cache_groups(cfg)

    def with_tables(cache: decode.Cache, table_SM) -> decode.Cache:
        paged, per_slot = _split(cache)
        return _join(decode.Cache({k: (pool, paged_cache.Table(table_SM)) for k, (pool, _) in paged.stacks.items()}),
                     per_slot)

    def empty():
        zeros = jnp.zeros((slots,), jnp.int32)
        pools = decode.Cache({k: (paged_cache.empty(cfg, k[0], k[1], len(layers), num_blocks, C), None)
                              for k, layers in groups.items() if k[0] in paged_cache.PAGED})
        per_slot = _split(decode.empty_cache(cfg, slots, length))[1]
        cache = with_tables(_join(pools, per_slot), jnp.zeros((slots, width), jnp.int32))
        return Slots(cache, jnp.zeros((slots, 1, D), jnp.dtype(cfg.dtype)), zeros, zeros, zeros, zeros,
                     jnp.zeros((slots,), bool))

    def prefill(params, prompt_BP, lengths_B):
        model = nnx.merge(graphdef, params)
        B = prompt_BP.shape[0]
        x_BPD, cache = decode.forward(model, prompt_BP, jnp.broadcast_to(jnp.arange(P), (B, P)), lengths_B,
                                      decode.empty_cache(cfg, B, P), decode.prefill_config(cfg, P, context.shards()))
        return cache, jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1)

    def insert(state: Slots, cache, x_B1D, rows_K, slots_K, prompts_K, gens_K, lengths_K, n,
               copy_rows_X, copy_cols_X, copy_blocks_X):
        paged, per_slot = _split(state.cache)
        paged = decode.Cache({k: (paged_cache.write_prompt(pool, cache.stacks[k][0], copy_rows_X, copy_cols_X,
                                                           copy_blocks_X), table)
                              for k, (pool, table) in paged.stacks.items()})
        src = _split(cache)[1]

        def one(i, s):
            per, rest = s
            row, slot = rows_K[i], slots_K[i]
            x, pos, count, prompt, gen, live = rest
            return copy_row(per, src, row, slot), (
                x.at[slot].set(x_B1D[row].astype(x.dtype)), pos.at[slot].set(lengths_K[i]), count.at[slot].set(0),
                prompt.at[slot].set(prompts_K[i]), gen.at[slot].set(gens_K[i]), live.at[slot].set(True))
        per_slot, rest = jax.lax.fori_loop(0, n, one, (per_slot, tuple(state[1:])))
        return Slots(_join(paged, per_slot), *rest)

    def step(params, s: Slots, key, table_SM):
        model = nnx.merge(graphdef, params)
        keys_S = jax.vmap(lambda p, g, t: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, p), g), t))(
            s.prompt_S, s.gen_S, s.count_S)
        token_S, logp_S = decode.sample(model.logits(s.x_S1D)[:, 0], keys_S, sampling.temperature,
                                        sampling.top_k, sampling.top_p)
        count_S = s.count_S + 1
        ended_S = jnp.isin(token_S, end_ids) | (count_S >= sampling.max_new_tokens)
        # an idle or ended slot writes nothing (length 0; its table row is the null block once released)
        lengths_S = jnp.where(s.live_S, s.pos_S + 1, 0)
        x_S1D, cache = decode.forward(model, token_S[:, None], s.pos_S[:, None], lengths_S,
                                      with_tables(s.cache, table_SM))
        live = s.live_S.astype(jnp.int32)
        new = Slots(cache, x_S1D, s.pos_S + live, count_S, s.prompt_S, s.gen_S, s.live_S & ~ended_S)
        out_3S = jnp.stack([token_S, jax.lax.bitcast_convert_type(logp_S, jnp.int32), ended_S.astype(jnp.int32)])
        return new, out_3S

    def shrink(s: Slots, rows_K) -> Slots:
        paged, per_slot = _split(s.cache)
        narrow = jnp.zeros((rows_K.shape[0], width), jnp.int32)  # placeholder: each step passes the tables
        return Slots(with_tables(_join(paged, take_rows(per_slot, rows_K)), narrow), *(a[rows_K] for a in s[1:]))

    return _Compiled(jax.jit(empty), jax.jit(prefill), jax.jit(insert, donate_argnums=0),
                     jax.jit(step, donate_argnums=1), jax.jit(shrink))


class PagedEngine(ContinuousEngine):
    """ContinuousEngine over a paged cache of `num_blocks` blocks (0: max_num_seqs × the longest
    sequence's blocks, + the null block) of `block_size` positions; `share_prefix=False` copies a
    prompt's blocks into each completion (for measuring what sharing saves)."""

    def __init__(self, cfg, graphdef, max_num_seqs: int, max_num_batched_tokens: int, block_size: int = 16,
                 num_blocks: int = 0, share_prefix: bool = True, hold_weights: bool = True):
        if (why := paged_cache.refusal({k.mixer for k in layer_kinds(cfg)})) is not None:
            raise ConfigError(why)
        super().__init__(cfg, graphdef, max_num_seqs, max_num_batched_tokens, hold_weights)
        self.block_size, self.num_blocks, self.share_prefix = block_size, num_blocks, share_prefix

    def generate(self, params, prompts, sampling: Sampling, key, first_prompt: int = 0, pad_to: int = 0):
        P, _ = self._shapes(prompts, sampling, pad_to)
        C, S = self.block_size, self.max_num_seqs
        width = blocks_for(P + sampling.max_new_tokens, C)
        blocks = self.num_blocks or S * width + 1
        need = blocks_for(max(map(len, prompts)) + sampling.max_new_tokens, C)
        if blocks - 1 < need:
            raise ConfigError(f"rollout_num_blocks={blocks} holds {blocks - 1} blocks of {C} positions (block 0 is "
                              f"the null block); the longest prompt + max_new_tokens needs {need}: raise it")
        self._pages = Pages(blocks, S, width, C, self.share_prefix)
        self._width, self._blocks = width, blocks
        done = super().generate(params, prompts, sampling, key, first_prompt, pad_to)
        pages = self._pages
        assert pages.in_use() == 0 and pages.promised == 0 and not pages.prompts, "blocks leaked"
        return done._replace(stats={**done.stats, "peak_blocks": pages.peak, "free_blocks": len(pages.free),
                                    "num_blocks": blocks, "block_bytes": self.block_bytes()})

    def block_bytes(self) -> int:
        """Bytes of one block across every paged stack (every layer's K/V or latents)."""
        shapes = [jax.eval_shape(lambda k=k, n=len(layers): paged_cache.empty(self.cfg, k[0], k[1], n, 1,
                                                                               self.block_size))
                  for k, layers in cache_groups(self.cfg).items() if k[0] in paged_cache.PAGED]
        return sum(a.size * a.dtype.itemsize for s in shapes for a in jax.tree.leaves(s))

    def _functions(self, P: int, Bp: int, width: int, sampling: Sampling):
        where = (P, Bp, width, self._width, self._blocks, sampling)
        if where not in self._compiled:
            self._compiled[where] = _compile(self.cfg, self.graphdef, width, P, self._width, self._blocks,
                                             self.block_size, sampling)
        return self._compiled[where]

    def _admits(self, p: int, lengths: np.ndarray, sampling: Sampling) -> bool:
        return self._pages.admits(p, int(lengths[p]), sampling.max_new_tokens)

    def _started(self, slot: int, p: int, g: int, row: int, length: int, sampling: Sampling) -> None:
        self._pages.start(slot, p, g, sampling.generations, row, int(length), sampling.max_new_tokens)

    def _release(self, slot: int) -> None:
        self._pages.release(slot)

    def _narrowed(self, rows: np.ndarray) -> None:
        self._pages.narrow(rows)

    def _step(self, fns, params, state: Slots, key, live: np.ndarray):
        self._pages.grow(live)
        return fns.step(params, state, key, jnp.asarray(self._pages.table.copy()))

    def _insert(self, fns, state: Slots, prefilled, inserts: list) -> Slots:
        if not inserts:
            return state
        columns = np.zeros((5, self.max_num_seqs), np.int32)
        columns[:, :len(inserts)] = np.asarray(inserts, np.int32).T
        copies = np.zeros((3, 2 * self.max_num_seqs * self._width), np.int32)  # at most M blocks per slot + prompt
        copies[2] = self._blocks  # past the pool: dropped
        taken = self._pages.take_copies()
        if taken:
            copies[:, :len(taken)] = np.asarray(taken, np.int32).T
        return fns.insert(state, *prefilled, *columns, np.int32(len(inserts)), *copies)
