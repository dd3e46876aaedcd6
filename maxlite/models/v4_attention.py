"""DeepSeek-V4's attention, as transformers' DeepseekV4Attention computes it (the `v4_*` mixer kinds):
one module per layer type; training runs the whole sequence at once, decoding runs the same pieces over
its cache (maxlite/models/v4_cache.py).

Every layer is multi-query attention with ONE head that is key and value at once: kv = RMSNorm(x·W_kv)
([H]). Queries come through a latent, q = rms(RMSNorm(x·W_q_a)·W_q_b) (each head RMS-normed without a
scale). RoPE is DeepSeek's interleaved pairs on the TRAILING R = qk_rope_head_dim channels of each head
(the leading H − R are not rotated). Since the values carry the keys' rotation, the output's trailing R
channels are turned back by the query's own angle (−sin), so that what each key contributes depends on
its distance only. Scores are scaled by 1/√H; each head's softmax (float32) also holds exp(sink) of a
learned per-head logit that takes no value (gpt-oss's sinks). The output projection is grouped: the N
heads in G = o_groups groups, each group's N·H/G channels projected to L = o_lora_rank, the G·L
concatenated and projected to D.

- SlidingAttention: each query attends the last `sliding_window` tokens (itself included, key j with
  i − W < j ≤ i, transformers' sliding mask). RoPE base rope_max_timescale, never scaled ("main").
- HeavilyCompressedAttention: besides, one compressed entry per m = compress_rate_hca tokens (windows
  that do not overlap): the window's kv projections pooled by a softmax over its m tokens of gate
  projections plus a learned bias per slot, RMS-normed, rotated at the window's first position. A query
  at position p attends every entry whose window has ended, e < (p + 1) // m.
- CompressedSparseAttention: entries every m = compress_rate_csa tokens pooled over 2m tokens (window
  e's second series and window e − 1's first: the projections are two entries wide), and of those a
  query sees only the `index_topk` a lightning indexer scores highest: the indexer pools its own keys
  the same way (index_head_dim wide), and scores entry e for query t as Σ_i w_{t,i}·ReLU(q_{t,i}·k_e)/√J,
  w = x·W_w/√I, q = RMSNorm(x·W_q_a)·W_Iq rotated. Entries past the query's window end are never kept.
  The compressed layers' RoPE (queries, keys, entries and the indexer alike) has base
  compress_rope_max_timescale, with YaRN when rope_scaling_type says so, its attention factor 1
  (DeepseekV4Config forces it: the reference does not scale cos/sin).

Rows may be packed: a document's windows are its own (positions 0, m, 2m, … within its segment:
`windows`), an entry is seen by its document's queries once its window has ended, and the sliding
part keeps to the query's segment; a row holding one sequence from position 0 has transformers'
windows (offsets 0, m, …). Padding (segment 0) makes no entry.

The attention is a block of W = sliding_window queries at a time against its window's keys and the
entries (`attend_banded`: scores [B, T/W, N, W, 2W + E] in float32, E the compressed entries), or
every pair where the sequence is short (T ≤ 2W) and in decoding (`attend_dense`). The
indexer picks entries by integer index, so, as in transformers, the language model's loss does not
reach it; training gives it its own, DeepSeek-V3.2's sparse-stage loss (maxlite/models/dsa.py
`with_indexer_loss`: the KL of its scores of its chosen entries to the heads' attention over them),
its inputs detached. No LoRA adapters on these layers.

Shape legend as in layers.py (S: the keys, the T tokens then the E entries), plus R the RoPE width,
Q the query latent, E compressed entries (at most T // m), M the tokens one entry pools (m, or 2m overlapping),
W a compressor's entry width (H, or J), C its projections' width (W, or 2W overlapping), I the
indexer's heads, J their width, k the entries each query keeps, G output groups, L each group's
projected width.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxlite.models import lora
from maxlite.models.attention import softmax_with_sinks
from maxlite.models.attention_mask import visible
from maxlite.models.dsa import indexer_target, with_indexer_loss
from maxlite.models.layers import BTD, RMSNorm, constrain, l2_norm, param, rope_frequencies
from maxlite.models.matmul import project

HEADS = ("activation_batch", "activation_length", "activation_heads", None)


def rope_inverse_frequencies(cfg, compressed: bool) -> np.ndarray:
    """[R/2]: the sliding layers' ("main": base rope_max_timescale, never scaled) or the compressed
    layers' ("compress": base compress_rope_max_timescale, rope_scaling_* applied; a factor of 0 is none)."""
    if compressed:
        cfg = dataclasses.replace(cfg, rope_max_timescale=cfg.compress_rope_max_timescale)
    else:
        cfg = dataclasses.replace(cfg, rope_scaling_factor=0.0)
    return rope_frequencies(cfg, dims=cfg.qk_rope_head_dim)


def rope_trailing(x_BTNH, positions_BT, inv_freq, inverse: bool = False):
    """V4's RoPE (transformers' apply_rotary_pos_emb): the trailing 2·len(inv_freq) channels of each
    head turned in interleaved pairs (2j, 2j + 1) by position·inv_freq[j], in float32; `inverse` turns
    them back (−sin). The leading channels pass as they are."""
    R = 2 * inv_freq.shape[-1]
    angles_BTr = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    sin, cos = jnp.sin(angles_BTr)[:, :, None, :], jnp.cos(angles_BTr)[:, :, None, :]
    if inverse:
        sin = -sin
    x = x_BTNH.astype(jnp.float32)
    even, odd = x[..., -R::2], x[..., -R + 1::2]
    turned = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(*x.shape[:-1], R)
    return jnp.concatenate([x[..., :-R], turned], axis=-1).astype(x_BTNH.dtype)


class Windows(NamedTuple):
    """A row's whole windows of one document, at most T // rate of them, in row order: the row offset
    of each one's first token [B, E], its position in its document (a multiple of rate), its segment,
    whether the slot holds a window at all."""
    start_BE: jax.Array
    pos_BE: jax.Array
    seg_BE: jax.Array
    valid_BE: jax.Array

    def seen(self, positions_BT, segment_ids_BT, rate: int):
        """[B, T, E]: the entries a query sees: of its own document, their window ended at or before
        it (transformers' e < (p + 1) // m; an overlapping entry's earlier half ended before that)."""
        return (self.valid_BE[:, None, :] & (self.seg_BE[:, None, :] == segment_ids_BT[:, :, None])
                & (self.pos_BE[:, None, :] + rate <= positions_BT[:, :, None] + 1))


def windows(positions_BT, segment_ids_BT, rate: int) -> Windows:
    """Each row's whole windows: `rate` tokens of one document (segment ≠ 0) from one of its positions
    0, rate, 2·rate, …. A row holding one sequence from position 0 has them at offsets 0, rate, …
    (transformers' windows); in a packed row each document has its own, wherever it starts."""
    B, T = positions_BT.shape
    E, j = T // rate, jnp.arange(T)
    last = jnp.broadcast_to(jnp.minimum(j + rate - 1, T - 1), (B, T))
    whole = ((positions_BT % rate == 0) & (j + rate <= T) & (segment_ids_BT != 0)
             & (jnp.take_along_axis(segment_ids_BT, last, axis=1) == segment_ids_BT)
             & (jnp.take_along_axis(positions_BT, last, axis=1) == positions_BT + rate - 1))
    start_BE = jnp.sort(jnp.where(whole, j, T + j), axis=1)[:, :E]  # the whole ones first, in row order
    valid_BE = start_BE < T
    start_BE = jnp.where(valid_BE, start_BE, 0)
    return Windows(start_BE, jnp.take_along_axis(positions_BT, start_BE, axis=1),
                   jnp.take_along_axis(segment_ids_BT, start_BE, axis=1), valid_BE)


class Compressor(nnx.Module):
    """One entry per `rate` tokens: the kv projections of a window pooled by a float32 softmax over its
    tokens of the gate projections + position_bias, RMS-normed, RoPE'd ("compress") at the window's first
    position. transformers' DeepseekV4HCACompressor (overlap=False, width H) and DeepseekV4CSACompressor
    (overlap=True: the projections hold two series, C = 2W; entry e pools window e − 1's first series and
    window e's second, 2·rate tokens; a document's window 0 has no predecessor, which weighs nothing); the
    indexer's keys too. Tokens after a document's last whole window make no entry."""

    def __init__(self, cfg, rate: int, width: int, overlap: bool, *, rngs: nnx.Rngs):
        D, C = cfg.base_emb_dim, (2 if overlap else 1) * width
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        self.kv = param(rngs, (D, C), ("embed", None), wd, scale=s)
        self.gate = param(rngs, (D, C), ("embed", None), wd, scale=s)
        self.position_bias = param(rngs, (rate, C), (None, None), jnp.float32, init="zeros")
        self.kv_norm = RMSNorm(width, cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype), wd, rngs=rngs)
        self.cfg, self.rate, self.width, self.overlap = cfg, rate, width, overlap

    def projections(self, x_BTD):
        """(kv, gate) projections of every token [B, T, C], float32: what the decode cache keeps."""
        return (project("btd,dc->btc", x_BTD, self.kv[...]).astype(jnp.float32),
                project("btd,dc->btc", x_BTD, self.gate[...]).astype(jnp.float32))

    def pool(self, kv_BSC, gate_BSC, wins: Windows):
        """entries_BEW, rotated at their windows' first positions, of the windows `wins` names."""
        B, S, C = kv_BSC.shape
        m, W = self.rate, self.width
        E = wins.start_BE.shape[1]

        def gather(x_BSC, offset: int):  # [B, E, m, C]: each window's m rows, `offset` rows later
            rows = jnp.clip(wins.start_BE[:, :, None] + offset + jnp.arange(m), 0, S - 1).reshape(B, E * m, 1)
            return jnp.take_along_axis(x_BSC, rows, axis=1).reshape(B, E, m, C)
        kv_BEMC = gather(kv_BSC, 0)
        gate_BEMC = gather(gate_BSC, 0) + self.position_bias[...].astype(jnp.float32)
        if self.overlap:  # the window before's first series (its document's), beside this one's second
            first = (wins.pos_BE >= m)[:, :, None, None]
            before_kv = jnp.where(first, gather(kv_BSC, -m)[..., :W], 0.0)
            before_gate = jnp.where(first, gather(gate_BSC, -m)[..., :W] + self.position_bias[...][:, :W], -jnp.inf)
            kv_BEMW = jnp.concatenate([before_kv, kv_BEMC[..., W:]], axis=2)
            gate_BEMW = jnp.concatenate([before_gate, gate_BEMC[..., W:]], axis=2)
        else:
            kv_BEMW, gate_BEMW = kv_BEMC, gate_BEMC
        pooled_BEW = jnp.sum(kv_BEMW * jax.nn.softmax(gate_BEMW, axis=2), axis=2)
        inv_freq = rope_inverse_frequencies(self.cfg, compressed=True)
        return rope_trailing(self.kv_norm(pooled_BEW)[:, :, None], wins.pos_BE, inv_freq)[:, :, 0]

    def __call__(self, x_BTD, wins: Windows):
        """entries_BEW, rotated."""
        return self.pool(*self.projections(x_BTD), wins)


class Indexer(Compressor):
    """The lightning indexer (transformers' DeepseekV4Indexer and DeepseekV4IndexerScorer): keys pooled
    as the CSA compressor's entries (J wide), queries from the attention's query latent, and each query's
    `index_topk` best entries among those whose window has ended."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, cfg.compress_rate_csa, cfg.index_head_dim, overlap=True, rngs=rngs)
        D, Q, I, J = cfg.base_emb_dim, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        self.q_b = param(rngs, (Q, I, J), ("embed", "heads", "head_dim"), wd, scale=s)
        self.weights_proj = param(rngs, (D, I), ("embed", None), wd, scale=s)
        self.topk = cfg.index_topk

    def scores(self, keys_BEJ, x_BTD, q_BTQ, positions_BT, seen_BTE):
        """The indexer's scores of its keys [B, T, E], float32, −inf where the query does not see the
        entry (`seen_BTE`). Its inputs are detached (`choose`'s callers): its own loss trains it."""
        I, J = self.q_b.shape[1:]
        q_BTIJ = rope_trailing(project("btq,qij->btij", q_BTQ, self.q_b[...]), positions_BT,
                               rope_inverse_frequencies(self.cfg, compressed=True))
        w_BTI = project("btd,di->bti", x_BTD, self.weights_proj[...]).astype(jnp.float32) * I ** -0.5
        per_head_BTIE = jax.nn.relu(jnp.einsum("btij,bej->btie", q_BTIJ.astype(jnp.float32),
                                               keys_BEJ.astype(jnp.float32))) * J ** -0.5
        scores_BTE = jnp.einsum("btie,bti->bte", per_head_BTIE, w_BTI)
        return jnp.where(seen_BTE, scores_BTE, -jnp.inf)

    def choose(self, keys_BEJ, x_BTD, q_BTQ, positions_BT, seen_BTE):
        """(the entries each query attends [B, T, k] — its top `index_topk` by score —, whether each
        is one it may see [B, T, k] (fewer while fewer windows have ended: a pick past the query's last
        ended window is dropped, transformers' −1), their scores [B, T, k]: the logits the indexer's
        loss reads)."""
        sg = jax.lax.stop_gradient
        scores_BTE = self.scores(keys_BEJ, sg(x_BTD), sg(q_BTQ), positions_BT, seen_BTE)
        _, index_BTk = jax.lax.top_k(sg(scores_BTE), min(self.topk, scores_BTE.shape[-1]))
        valid_BTk = jnp.take_along_axis(seen_BTE, index_BTk, axis=-1)
        return index_BTk, valid_BTk, jnp.take_along_axis(scores_BTE, index_BTk, axis=-1)


def chosen_mask(index_BTk, valid_BTk, num_entries: int):
    """[B, T, E]: the entries a query attends, from the indexer's choice."""
    return jnp.any((index_BTk[..., None] == jnp.arange(num_entries)) & valid_BTk[..., None], axis=2)


class SlidingAttention(nnx.Module):
    """transformers' DeepseekV4Attention of a "sliding_attention" layer (no compressor, the "main"
    RoPE); the base of the compressed layers, which add entries to its keys (`compressed_keys`)."""

    compressed_rope = False  # which RoPE: the "compress" one where True

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, N, H, Q = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.head_dim, cfg.q_lora_rank
        G, L = cfg.o_groups, cfg.o_lora_rank  # G ≥ 1 dividing N·H: the recipe's checks
        wd, s = jnp.dtype(cfg.weight_dtype), cfg.init_scale
        dt, eps = jnp.dtype(cfg.dtype), cfg.normalization_layer_epsilon
        self.q_a = param(rngs, (D, Q), ("embed", None), wd, scale=s)
        self.q_a_norm = RMSNorm(Q, eps, dt, wd, rngs=rngs)
        self.q_b = param(rngs, (Q, N, H), ("embed", "heads", "head_dim"), wd, scale=s)
        self.kv = param(rngs, (D, H), ("embed", "head_dim"), wd, scale=s)
        self.kv_norm = RMSNorm(H, eps, dt, wd, rngs=rngs)
        # a group is N/G consecutive heads: split over `tensor` like the heads
        self.o_a = param(rngs, (G, N * H // G, L), ("heads", "head_dim", None), wd, scale=s)
        self.o_b = param(rngs, (G * L, D), ("heads", "embed"), wd, scale=s)
        self.sinks = param(rngs, (N,), ("heads",), jnp.float32, init="zeros")
        self.cfg = cfg
        self.add_compressed(cfg, rngs)
        lora.attach(self, cfg, rngs, {  # LoRA on transformers' projections, after every base weight
            "q_a_proj": (1, {"q_a": ((D, Q), ("embed", None))}),
            "q_b_proj": (1, {"q_b": ((Q, N, H), ("embed", "heads", "head_dim"))}),
            "kv_proj": (1, {"kv": ((D, H), ("embed", "head_dim"))}),
            "o_b_proj": (1, {"o_b": ((G * L, D), ("heads", "embed"))})})

    def add_compressed(self, cfg, rngs: nnx.Rngs) -> None:
        """A compressed layer's compressor (and indexer); the sliding layer has none."""

    def queries(self, x_BTD, positions_BT, dropout_key=None):
        """(the queries [B, T, N, H], rotated; the query latent [B, T, Q] the indexer reads too)."""
        q_BTQ = self.q_a_norm(lora.adapt(self, "q_a", x_BTD, project("btd,dq->btq", x_BTD, self.q_a[...]),
                                         dropout_key=dropout_key))
        q_BTNH = l2_norm(lora.adapt(self, "q_b", q_BTQ, project("btq,qnh->btnh", q_BTQ, self.q_b[...]),
                                    dropout_key=dropout_key), self.cfg.normalization_layer_epsilon)
        q_BTNH = rope_trailing(q_BTNH, positions_BT, rope_inverse_frequencies(self.cfg, self.compressed_rope))
        return checkpoint_name(constrain(q_BTNH, HEADS), "query_proj"), q_BTQ

    def keys(self, x_BTD, positions_BT, dropout_key=None):
        """The one key=value head of each token [B, T, H], rotated."""
        kv_BTH = self.kv_norm(lora.adapt(self, "kv", x_BTD, project("btd,dh->bth", x_BTD, self.kv[...]),
                                         dropout_key=dropout_key))
        kv_BTH = rope_trailing(kv_BTH[:, :, None], positions_BT, rope_inverse_frequencies(self.cfg, self.compressed_rope))
        return checkpoint_name(kv_BTH[:, :, 0], "key_proj")

    def attend(self, q_BTNH, keys_BSH, seen_BTS):
        """(softmax attention of every head over the one key=value head, the sinks in each denominator;
        the probabilities [B, N, T, S], float32)."""
        H = q_BTNH.shape[-1]
        scores_BNTS = project("btnh,bsh->bnts", q_BTNH, keys_BSH).astype(jnp.float32) * H ** -0.5
        scores_BNTS = jnp.where(seen_BTS[:, None], scores_BNTS, -jnp.inf)  # every row sees its own token
        probs_BNTS = softmax_with_sinks(scores_BNTS[:, None], self.sinks[...])[:, 0]
        return project("bnts,bsh->btnh", probs_BNTS.astype(q_BTNH.dtype), keys_BSH), probs_BNTS

    def out(self, out_BTNH, positions_BT, dropout_key=None):
        """The values' rotation turned back by the query's own angle (they carried their keys'), then
        the grouped output projection: [B, T, N, H] → G groups of N·H/G → G·L → D."""
        out_BTNH = rope_trailing(out_BTNH, positions_BT, rope_inverse_frequencies(self.cfg, self.compressed_rope),
                                 inverse=True)
        B, T, N, H = out_BTNH.shape
        G, _, L = self.o_a.shape
        # the groups leading, a batched product XLA:CPU computes in both directions (a batch axis between
        # others makes the gradient's bf16 × bf16 → f32 dot one it cannot: DotThunk UNIMPLEMENTED)
        x_GXI = jnp.moveaxis(constrain(out_BTNH, HEADS).reshape(B * T, G, N * H // G), 1, 0)
        grouped_GXL = project("gxi,gil->gxl", x_GXI, self.o_a[...])
        grouped_BTC = jnp.moveaxis(grouped_GXL, 0, 1).reshape(B, T, G * L)
        out_BTD = lora.adapt(self, "o_b", grouped_BTC, project("btc,cd->btd", grouped_BTC, self.o_b[...]),
                             dropout_key=dropout_key)
        return constrain(checkpoint_name(out_BTD, "out_proj"), BTD)

    def compressed(self, seen_BTE, q_BTQ, positions_BT, index_keys_BEJ=None, x_BTD=None):
        """(which entries each query attends [B, T, E], the indexer's choice or None): those it sees
        (a layer with an indexer: of those, its choice)."""
        return seen_BTE, None

    def entries(self, projected, index_projected, pos_BS, seg_BS, q_BTQ, positions_BT, q_seg_BT, x_BTD):
        """(the compressed entries [B, E, H], which each query attends [B, T, E], the indexer's choice
        or None) from the compressor's (kv, gate) projections of S positions (`pos_BS`, `seg_BS`: a
        sequence's own, or the decode cache's slots) and the indexer's (None without one); the queries
        at `positions_BT` of segments `q_seg_BT`."""
        wins = windows(pos_BS, seg_BS, self.rate)
        entries_BEH = self.compressor.pool(*projected, wins)
        seen_BTE = wins.seen(positions_BT, q_seg_BT, self.rate)
        index_keys = None if index_projected is None else self.indexer.pool(*index_projected, wins)
        seen_BTE, choice = self.compressed(seen_BTE, q_BTQ, positions_BT, index_keys, x_BTD)
        return entries_BEH, seen_BTE, choice

    def attend_dense(self, q_BTNH, kv_BSH, seen_BTS, entries_BEH=None, entries_seen_BTE=None):
        """(the attention over the S keys `seen_BTS` marks and the entries after them, every pair scored:
        out_BTNH; the entries' probabilities [B, N, T, E] or None). Decoding's (T new tokens against the
        cache) and short sequences'."""
        keys_BSH, seen = kv_BSH, seen_BTS
        if entries_BEH is not None:
            keys_BSH = jnp.concatenate([kv_BSH, entries_BEH.astype(kv_BSH.dtype)], axis=1)
            seen = jnp.concatenate([seen_BTS, entries_seen_BTE], axis=-1)
        out_BTNH, probs_BNTS = self.attend(q_BTNH, keys_BSH, seen)
        return out_BTNH, (None if entries_BEH is None else probs_BNTS[..., kv_BSH.shape[1]:])

    def attend_banded(self, q_BTNH, kv_BTH, segment_ids_BT, entries_BEH=None, entries_seen_BTE=None):
        """`attend_dense` over a sequence's own keys, a block of W = sliding_window queries at a time
        against its block's keys and the block's before (2W: every key of their windows) and the
        entries, one softmax over both: scores [B, T/W, N, W, 2W + E] where every pair would be
        [B, N, T, T + E]."""
        B, T, N, H = q_BTNH.shape
        W = self.cfg.sliding_window
        nb = -(-T // W)
        pad = ((0, 0), (0, nb * W - T))
        q_BQRNH = jnp.pad(q_BTNH, pad + ((0, 0), (0, 0))).reshape(B, nb, W, N, H)
        kv_BLH = jnp.pad(kv_BTH, ((0, 0), (W, nb * W - T), (0, 0)))  # a block of nothing before the first
        keys_BQKH = jnp.concatenate([kv_BLH[:, :nb * W].reshape(B, nb, W, H), kv_BLH[:, W:].reshape(B, nb, W, H)],
                                    axis=2)
        seg = jnp.pad(segment_ids_BT, ((0, 0), (W, nb * W - T)), constant_values=-1)
        q_seg_BQR = seg[:, W:].reshape(B, nb, W)
        k_seg_BQK = jnp.concatenate([seg[:, :nb * W].reshape(B, nb, W), q_seg_BQR], axis=2)
        rows_QR = jnp.arange(nb * W).reshape(nb, W)
        cols_QK = jnp.concatenate([rows_QR - W, rows_QR], axis=1)
        seen_BQRK = (visible(rows_QR[:, :, None], cols_QK[:, None, :], W)[None]
                     & (q_seg_BQR[..., None] == k_seg_BQK[:, :, None, :]))
        scores = project("bqrnh,bqkh->bqnrk", q_BQRNH, keys_BQKH).astype(jnp.float32) * H ** -0.5
        scores = jnp.where(seen_BQRK[:, :, None], scores, -jnp.inf)
        E = 0 if entries_BEH is None else entries_BEH.shape[1]
        if E:
            entries_BEH = entries_BEH.astype(kv_BTH.dtype)
            scores_e = project("bqrnh,beh->bqnre", q_BQRNH, entries_BEH).astype(jnp.float32) * H ** -0.5
            seen_e = jnp.pad(entries_seen_BTE, pad + ((0, 0),)).reshape(B, nb, W, E)
            scores = jnp.concatenate([scores, jnp.where(seen_e[:, :, None], scores_e, -jnp.inf)], axis=-1)
        probs = softmax_with_sinks(scores.reshape(B * nb, N, 1, W, -1), self.sinks[...]).reshape(scores.shape)
        dt = q_BTNH.dtype
        out = project("bqnrk,bqkh->bqrnh", probs[..., :2 * W].astype(dt), keys_BQKH)
        probs_e = None
        if E:
            out = out + project("bqnre,beh->bqrnh", probs[..., 2 * W:].astype(dt), entries_BEH)
            probs_e = jnp.moveaxis(probs[..., 2 * W:], 2, 1).reshape(B, N, nb * W, E)[:, :, :T]
        return out.reshape(B, nb * W, N, H)[:, :T], probs_e

    def finish(self, out_BTNH, probs_BNTE, choice, positions_BT, dropout_key=None):
        """The output through the grouped projection; with an indexer's choice, its loss attached
        (maxlite/models/dsa.py `with_indexer_loss`: the heads' attention over the chosen entries is its
        target)."""
        if choice is not None:
            index_BTk, valid_BTk, logits_BTk = choice
            probs_BTNk = jnp.take_along_axis(jnp.moveaxis(probs_BNTE, 1, 2), index_BTk[:, :, None, :], axis=-1)
            out_BTNH = with_indexer_loss(out_BTNH, logits_BTk, indexer_target(probs_BTNk, valid_BTk), valid_BTk)
        return self.out(out_BTNH, positions_BT, dropout_key)

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, local=False):
        T, W = x_BTD.shape[1], self.cfg.sliding_window
        q_BTNH, q_BTQ = self.queries(x_BTD, positions_BT, dropout_key)
        kv_BTH = self.keys(x_BTD, positions_BT, dropout_key)
        entries_BEH, seen_BTE, choice = None, None, None
        if hasattr(self, "compressor") and T >= self.rate:  # room for a whole window
            # the indexer's inputs detached: its own loss trains it, nothing else does
            index = self.indexer.projections(jax.lax.stop_gradient(x_BTD)) if hasattr(self, "indexer") else None
            entries_BEH, seen_BTE, choice = self.entries(self.compressor.projections(x_BTD), index, positions_BT,
                                                         segment_ids_BT, q_BTQ, positions_BT, segment_ids_BT, x_BTD)
        if W and T > 2 * W:
            out_BTNH, probs_BNTE = self.attend_banded(q_BTNH, kv_BTH, segment_ids_BT, entries_BEH, seen_BTE)
        else:
            idx_T = jnp.arange(T)
            seen_BTS = (visible(idx_T[:, None], idx_T[None, :], W)[None]
                        & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]))
            out_BTNH, probs_BNTE = self.attend_dense(q_BTNH, kv_BTH, seen_BTS, entries_BEH, seen_BTE)
        return self.finish(out_BTNH, probs_BNTE, choice, positions_BT, dropout_key)


class HeavilyCompressedAttention(SlidingAttention):
    """transformers' DeepseekV4Attention of a "heavily_compressed_attention" layer (DeepseekV4HCACompressor):
    the sliding keys and every ended entry of windows of compress_rate_hca tokens that do not overlap."""

    compressed_rope = True

    def add_compressed(self, cfg, rngs: nnx.Rngs) -> None:
        self.compressor = Compressor(cfg, cfg.compress_rate_hca, cfg.head_dim, overlap=False, rngs=rngs)
        self.rate = cfg.compress_rate_hca


class CompressedSparseAttention(SlidingAttention):
    """transformers' DeepseekV4Attention of a "compressed_sparse_attention" layer (DeepseekV4CSACompressor
    and its DeepseekV4Indexer): the sliding keys and the index_topk entries the indexer picks among the
    ended ones, entries every compress_rate_csa tokens pooled over twice that. Training trains the
    indexer by its own loss (the KL of its scores to the heads' attention over its choice, as
    DeepSeek-V3.2's sparse stage: maxlite/models/dsa.py), which transformers' model does not have."""

    compressed_rope = True

    def add_compressed(self, cfg, rngs: nnx.Rngs) -> None:
        self.compressor = Compressor(cfg, cfg.compress_rate_csa, cfg.head_dim, overlap=True, rngs=rngs)
        self.indexer = Indexer(cfg, rngs=rngs)
        self.rate = cfg.compress_rate_csa

    def compressed(self, seen_BTE, q_BTQ, positions_BT, index_keys_BEJ=None, x_BTD=None):
        choice = self.indexer.choose(index_keys_BEJ, x_BTD, q_BTQ, positions_BT, seen_BTE)
        return chosen_mask(choice[0], choice[1], seen_BTE.shape[-1]), choice
