"""maxlite's rollout engine: continuous batching over a fixed number of decode slots, each prompt
prefilled once for its G completions.

The cache here is slot-contiguous: slot s owns row s of every layer's decode cache
(maxlite/models/decode.py, each mixer kind's own: K/V rings, MLA's latents, the delta-net's state,
Gemma 4's shared K/V), sized for the longest padded prompt + max_new_tokens. The paged engine
(maxlite/rollout/paged.py, `rollout_paged_kv`) keeps this loop and fills in its cache hooks
(`_admits`, `_started`, `_release`, `_narrowed`, `_step`): a pool of blocks and a block table per slot.

Three compiled functions with fixed shapes, called from a host loop:
- `prefill`: a chunk of prompts ([Bp, P]: Bp = max_num_batched_tokens // P; P the longest prompt's
  length rounded up to a power of two, `sampling.bucket`, so batches of other lengths reuse the
  programs) through the training attention into a cache of Bp rows, and each prompt's last hidden
  state;
- `insert`: rows of that cache copied into free slots (maxlite/rollout/slots.py) — a prompt's G
  completions are G copies of its one prefill —, each slot at its own position, its count reset;
- `step`: for every slot, sample a token from its last hidden state (decode.sample, `generate`'s
  rule: temperature, top_k, top_p; a per-row key), its log-prob under the cut distribution, and
  whether it ended (an end id, or max_new_tokens), then the token through the model (slots × 1 token).
  The host reads one [3, slots] array per step (tokens, log-probs, ended), one step behind the
  device (the next step is already dispatched: the device does not wait for the host's bookkeeping),
  frees the ended slots and refills them with waiting completions, so a slot holds an ended sequence
  for at most one step beyond the step that ended it (none when it ended by max_new_tokens, known in
  advance), except when nothing is left to start (the tail of the batch);
- `shrink`: in that tail, once at most half the slots are live, the live ones are cut out into a
  batch half as wide (down to max_num_seqs / 8), whose step is compiled once too.

The key of a token is fold_in(key, prompt index, completion index, token index): what is sampled
depends neither on the slot a sequence lands in nor on max_num_seqs.
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxlite.models import context, decode
from maxlite.rollout.sampling import Completions, Sampling, bucket
from maxlite.rollout.slots import copy_row, take_rows
from maxlite.schema import ConfigError


class Slots(NamedTuple):
    """The decode slots' state on the device (S slots)."""
    cache: decode.Cache
    x_S1D: jax.Array  # each slot's last hidden state: the next token is sampled from it
    pos_S: jax.Array  # the next position to write: the sequence's length so far
    count_S: jax.Array  # tokens sampled so far
    prompt_S: jax.Array  # the sequence held (prompt index, completion index): its RNG stream
    gen_S: jax.Array
    live_S: jax.Array  # holds a sequence that has not ended


class _Compiled(NamedTuple):
    empty: object
    prefill: object
    insert: object
    step: object
    shrink: object


def _compile(cfg, graphdef, slots: int, length: int, sampling: Sampling) -> _Compiled:
    """The engine's jitted functions for `slots` slots and caches of `length` positions."""
    end_ids = jnp.asarray(sampling.end_ids() or (-1,), jnp.int32)
    D = cfg.base_emb_dim

    def empty():
        zeros = jnp.zeros((slots,), jnp.int32)
        return Slots(decode.empty_cache(cfg, slots, length), jnp.zeros((slots, 1, D), jnp.dtype(cfg.dtype)),
                     zeros, zeros, zeros, zeros, jnp.zeros((slots,), bool))

    def prefill(params, prompt_BP, lengths_B):
        model = nnx.merge(graphdef, params)
        B, P = prompt_BP.shape
        x_BPD, cache = decode.forward(model, prompt_BP, jnp.broadcast_to(jnp.arange(P), (B, P)), lengths_B,
                                      decode.empty_cache(cfg, B, length),
                                      decode.prefill_config(cfg, P, context.shards()))
        return cache, jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1)

    def insert(state: Slots, cache, x_B1D, rows_K, slots_K, prompts_K, gens_K, lengths_K, n):
        def one(i, s: Slots) -> Slots:
            row, slot = rows_K[i], slots_K[i]
            return Slots(copy_row(s.cache, cache, row, slot), s.x_S1D.at[slot].set(x_B1D[row].astype(s.x_S1D.dtype)),
                         s.pos_S.at[slot].set(lengths_K[i]), s.count_S.at[slot].set(0),
                         s.prompt_S.at[slot].set(prompts_K[i]), s.gen_S.at[slot].set(gens_K[i]),
                         s.live_S.at[slot].set(True))
        return jax.lax.fori_loop(0, n, one, state)

    def step(params, s: Slots, key):
        model = nnx.merge(graphdef, params)
        keys_S = jax.vmap(lambda p, g, t: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, p), g), t))(
            s.prompt_S, s.gen_S, s.count_S)
        token_S, logp_S = decode.sample(model.logits(s.x_S1D)[:, 0], keys_S, sampling.temperature,
                                        sampling.top_k, sampling.top_p)
        count_S = s.count_S + 1
        ended_S = jnp.isin(token_S, end_ids) | (count_S >= sampling.max_new_tokens)
        x_S1D, cache = decode.forward(model, token_S[:, None], s.pos_S[:, None], s.pos_S + 1, s.cache)
        live = s.live_S.astype(jnp.int32)
        new = Slots(cache, x_S1D, s.pos_S + live, count_S, s.prompt_S, s.gen_S, s.live_S & ~ended_S)
        # one array for the host: tokens, log-probs (their float32 bits) and ended, per slot
        out_3S = jnp.stack([token_S, jax.lax.bitcast_convert_type(logp_S, jnp.int32), ended_S.astype(jnp.int32)])
        return new, out_3S

    def shrink(s: Slots, rows_K) -> Slots:
        return Slots(take_rows(s.cache, rows_K), *(a[rows_K] for a in s[1:]))

    return _Compiled(jax.jit(empty), jax.jit(prefill), jax.jit(insert, donate_argnums=0),
                     jax.jit(step, donate_argnums=1), jax.jit(shrink))


class ContinuousEngine:
    """`generate(params, prompts, sampling, key) → Completions` (maxlite/rollout/engine.py) with
    `max_num_seqs` decode slots and at most `max_num_batched_tokens` prompt tokens per prefill."""

    def __init__(self, cfg, graphdef, max_num_seqs: int, max_num_batched_tokens: int, hold_weights: bool = True):
        self.cfg, self.graphdef = cfg, graphdef
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self._compiled: dict = {}
        # the jitted rounding of a push's weights (maxlite/rollout/weights.py), once known; False: the
        # trainer's weights as they come (the same tokens and log-probs, each step re-rounding them)
        self._hold = None if hold_weights else (lambda params: params)

    def held(self, params):
        """The pushed weights as the engine holds them: the layers' matmul weights in the compute dtype
        (maxlite/rollout/weights.py; which ones is read once, from the model's traced forward)."""
        if self._hold is None:
            import functools

            from maxlite.rollout import weights
            self._hold = jax.jit(functools.partial(weights.held, self.cfg,
                                                   weights.held_paths(self.cfg, self.graphdef, params)))
        return self._hold(params)

    def _shapes(self, prompts, sampling: Sampling, pad_to: int = 0) -> tuple[int, int]:
        """(the padded prompt length P, the prompts per prefill Bp), or the one line saying what is wrong."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError("every prompt needs at least one token")
        if sampling.max_new_tokens < 1 or sampling.generations < 1:
            raise ConfigError("max_new_tokens and generations must be at least 1")
        if (why := decode.sampling_refusal(sampling.temperature, sampling.top_k, sampling.top_p)) is not None:
            raise ConfigError(why)
        longest = max(pad_to, *map(len, prompts))
        room = self.cfg.max_position_embeddings - sampling.max_new_tokens
        if longest > room:
            raise ConfigError(f"prompt ({longest} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds "
                              f"the model's max_position_embeddings={self.cfg.max_position_embeddings}")
        # a power-of-two bucket (at least 16) inside the recipe's own prompt budget where the prompt fits
        # it: every compiled function is keyed by P, so batches of other longest prompts reuse them
        # (grpo_math.yml compiled them 6 times in its first 8 steps, one per new length; now twice)
        budget = min(room, self.max_num_batched_tokens, self.cfg.max_target_length - sampling.max_new_tokens)
        P = decode.prompt_length(self.cfg, bucket(longest, budget, least=16), context.shards())
        if self.max_num_batched_tokens < P:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} is below the longest prompt "
                              f"({P} tokens padded): raise it")
        return P, min(len(prompts), self.max_num_batched_tokens // P)

    def generate(self, params, prompts, sampling: Sampling, key, first_prompt: int = 0, pad_to: int = 0) -> Completions:
        """`first_prompt`, `pad_to`: for a share of a larger batch (maxlite/rollout/actors.py): the
        index of its first prompt there (the RNG stream) and the batch's longest prompt (the padding).

        The host runs one step behind the device: step t+1 is dispatched before step t's tokens are
        read, so the device never waits for the host's bookkeeping. A sequence that reaches
        max_new_tokens at step t frees its slot for step t+1 (its end is known in advance); one that
        samples an end id at step t holds its slot through step t+1 (the device already marked it
        ended: its token there is dropped, and the slot-step counted as ended) and is replaced before
        step t+2."""
        P, Bp = self._shapes(prompts, sampling, pad_to)
        S, G, N = self.max_num_seqs, sampling.generations, len(prompts)
        fns = self._functions(P, Bp, S, sampling)
        params = self.held(params)
        lengths = np.array([len(p) for p in prompts], np.int32)
        padded = np.zeros((-(-N // Bp) * Bp, P), np.int32)
        for row, ids in zip(padded, prompts):
            row[:len(ids)] = ids
        padded_lengths = np.concatenate([lengths, np.ones(len(padded) - N, np.int32)])

        started = time.perf_counter()
        book = _Book(N * G, sampling)
        waiting = collections.deque((p, g) for p in range(N) for g in range(G))
        owner = np.full(S, -1, np.int64)  # the sequence each slot holds (-1: none)
        free = list(range(S - 1, -1, -1))
        state, chunk, prefilled = fns.empty(), -Bp, None
        pending = None  # the last dispatched step's output and the owners it was dispatched with
        dispatched = np.zeros(N * G, np.int64)  # steps dispatched for each sequence
        steps = prefills = 0
        while True:
            inserts = []
            while free and waiting and self._admits(waiting[0][0], lengths, sampling):
                p, g = waiting[0]
                if p >= chunk + Bp:  # the next prompts: prefill them (after placing the last ones' rows)
                    state = self._insert(fns, state, prefilled, inserts)
                    inserts, chunk = [], p - p % Bp
                    prefilled = fns.prefill(params, padded[chunk:chunk + Bp], padded_lengths[chunk:chunk + Bp])
                    prefills += 1
                waiting.popleft()
                slot = free.pop()
                owner[slot] = p * G + g
                self._started(slot, p, g, p - chunk, lengths[p], sampling)
                inserts.append((p - chunk, slot, first_prompt + p, g, lengths[p]))
            state = self._insert(fns, state, prefilled, inserts)
            live = np.flatnonzero(owner >= 0)
            if not waiting and 0 < len(live) <= len(owner) // 2 and len(owner) > max(S // 8, 1):
                if pending is not None:  # the narrower batch's rows are the live slots after the last step
                    self._free(book.read(*pending), owner, free)
                    pending = None
                    continue
                state, owner, fns = self._shrink(state, owner, live, P, Bp, sampling)
                free, live = [], np.arange(len(live))
            if len(live):
                # dispatched: it runs while the host reads the last
                state, out_3S = self._step(fns, params, state, key, live)
                steps += 1
                dispatched[owner[live]] += 1
                snapshot = owner.copy()
                full = live[dispatched[owner[live]] >= sampling.max_new_tokens]  # they end at this step
                owner[full] = -1
                free += full.tolist()
                for slot in full:
                    self._release(slot)
            if pending is not None:
                self._free(book.read(*pending), owner, free)
            if not len(live):
                assert not waiting, "nothing runs and nothing can start"
                break
            pending = (out_3S, snapshot)
        return Completions(*book.completions(), {"steps": steps, "slot_steps": book.slot_steps,
                                                 "ended_slot_steps": book.slot_steps - book.live_slot_steps,
                                                 "prefills": prefills, "seconds": time.perf_counter() - started})

    def _free(self, ended: list, owner: np.ndarray, free: list) -> None:
        """Free the slots of the sequences that ended (slot, sequence), unless already refilled."""
        for slot, seq in ended:
            if owner[slot] == seq:
                owner[slot] = -1
                free.append(slot)
                self._release(slot)

    # what a cache layout adds to the slots' bookkeeping (the paged one: maxlite/rollout/paged.py)
    def _admits(self, p: int, lengths: np.ndarray, sampling: Sampling) -> bool:
        return True  # a slot holds any sequence

    def _started(self, slot: int, p: int, g: int, row: int, length: int, sampling: Sampling) -> None:
        pass

    def _release(self, slot: int) -> None:
        pass

    def _narrowed(self, rows: np.ndarray) -> None:
        pass

    def _step(self, fns: _Compiled, params, state: Slots, key, live: np.ndarray):
        return fns.step(params, state, key)

    def _functions(self, P: int, Bp: int, width: int, sampling: Sampling) -> _Compiled:
        where = (P, Bp, width, sampling)
        if where not in self._compiled:
            self._compiled[where] = _compile(self.cfg, self.graphdef, width, P + sampling.max_new_tokens, sampling)
        return self._compiled[where]

    def _shrink(self, state: Slots, owner: np.ndarray, live: np.ndarray, P: int, Bp: int, sampling: Sampling):
        """(the state of the narrowest batch of halved width ≥ max_num_seqs / 8 holding the live
        slots, first, in order; its owners; its functions)."""
        width = len(owner)
        while width // 2 >= max(len(live), self.max_num_seqs // 8, 1):
            width //= 2
        rows = np.concatenate([live, np.flatnonzero(owner < 0)[:width - len(live)]]).astype(np.int32)
        fns = self._functions(P, Bp, width, sampling)
        self._narrowed(rows)
        return fns.shrink(state, rows), owner[rows], fns

    def _insert(self, fns: _Compiled, state: Slots, prefilled, inserts: list) -> Slots:
        """`inserts` ((prefill row, slot, prompt, completion, prompt length) each) placed in one call."""
        if not inserts:
            return state
        columns = np.zeros((5, self.max_num_seqs), np.int32)
        columns[:, :len(inserts)] = np.asarray(inserts, np.int32).T
        return fns.insert(state, *prefilled, *columns, np.int32(len(inserts)))


class _Book:
    """The host's record of the sequences: tokens and log-probs as the steps return them, why each
    stopped, and the slot-steps spent (with and without a live sequence)."""

    def __init__(self, n: int, sampling: Sampling):
        self.sampling, self.end_ids = sampling, np.asarray(sampling.end_ids() or (-1,), np.int32)
        self.tokens = np.zeros((n, sampling.max_new_tokens), np.int32)
        self.logps = np.zeros((n, sampling.max_new_tokens), np.float32)
        self.count = np.zeros(n, np.int64)
        self.stops: list = [None] * n
        self.done = np.zeros(n, bool)
        self.slot_steps = self.live_slot_steps = 0

    def read(self, out_3S, owner_S: np.ndarray) -> list[tuple[int, int]]:
        """Record a step's output (the step's one transfer to the host) for the slots `owner_S` said
        held a live sequence when it was dispatched; (slot, sequence) of those that ended there."""
        out_3S = np.asarray(out_3S)
        self.slot_steps += len(owner_S)
        slots = np.flatnonzero(owner_S >= 0)
        slots = slots[~self.done[owner_S[slots]]]  # a sequence that ended at the step before: its token is dropped
        seqs = owner_S[slots]
        self.live_slot_steps += len(slots)
        tokens, n = out_3S[0, slots], self.count[seqs]
        self.tokens[seqs, n] = tokens
        self.logps[seqs, n] = out_3S[1, slots].view(np.float32)
        self.count[seqs] = n + 1
        ended = out_3S[2, slots].astype(bool)
        # the device's rule and the host's agree (sampling.stop: an end id, or max_new_tokens)
        assert np.array_equal(ended, np.isin(tokens, self.end_ids) | (n + 1 >= self.sampling.max_new_tokens)), \
            (tokens, n, ended)
        for seq in seqs[ended]:
            self.stops[seq] = self.sampling.stop(int(self.tokens[seq, self.count[seq] - 1]), int(self.count[seq]))
        self.done[seqs[ended]] = True
        return list(zip(slots[ended].tolist(), seqs[ended].tolist()))

    def completions(self) -> tuple[list, list, list]:
        return ([self.tokens[i, :n].copy() for i, n in enumerate(self.count)],
                [self.logps[i, :n].copy() for i, n in enumerate(self.count)], self.stops)
