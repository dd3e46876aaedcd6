"""The decoder: embeddings, a stack of blocks (scanned or unrolled, with remat), the output head.

Shape legend as in layers.py (B batch, T time, D model dim, V vocab, P max positions, L layers).
A block is a token mixer + a feed-forward, each a registered kind chosen per layer
(maxlite/models/layout.py: `layer_kinds`, from the recipe's `layer_types` or the family's pattern);
`decoder_block` picks the family (maxlite/models/families.py), whose traits decide the norms (before,
after, or both around each branch), the MLP, positions, biases, q/k norms and the embedding scale.
A scanned model keeps its layers in `layout.layer_stacks`: stacks over the shortest repeating block of
the layers' (mixer, feed-forward) structures (a MoE model's dense layers before the first MoE one
apart). Layers of one stack position whose variants differ (Gemma 3's 5 local : 1 global) get their
variant as a scanned flag; attention branches on it (layers.Attention._attend). A routed
feed-forward's (MoE) routing statistics come back beside the hidden states (the auxiliary losses'
input). The layers pass one Carry (maxlite/models/carry.py): the hidden states and the model's sides
(maxlite/models/sides.py: per-layer inputs scanned with the layers, state the layers read and write,
a step each layer ends with), which the blocks hand on without knowing what is in it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import math

from maxlite.models import cache_bits, matmul, pipeline
from maxlite.models.carry import Carry, layer_inputs, start
from maxlite.models.families import family
from maxlite.models.hyper import STREAMS, HyperConnection, HyperHead, expand
from maxlite.models.kinds import FEED_FORWARDS, MIXERS
from maxlite.models.layers import BTD, constrain, make_norm, param
from maxlite.models.layout import layer_kinds, layer_place, layer_stacks, layer_windows
from maxlite.models.sides import ffn_args, mixer_args, sides
from maxlite.models.vision import towers
from maxlite.models.vision.merge import merge

_cp = jax.checkpoint_policies
_QKV = ("query_proj", "key_proj", "value_proj")
_MLP = ("mlpwi_0", "mlpwi_1", "mlpwo")
REMAT_POLICIES = {  # names: maxlite.models.layers' checkpoint_name calls and "decoder_layer_input"
    "full": _cp.nothing_saveable,  # recompute everything in the backward pass
    "minimal": matmul.dots_with_no_batch_dims_saveable,  # keep weight matmuls
    "save_dots": matmul.dots_saveable,  # keep every matmul output
    "save_qkv_proj": _cp.save_only_these_names(*_QKV),  # keep q, k, v (after RoPE)
    "save_dot_except_mlp": _cp.save_only_these_names(*_QKV, "out_proj"),  # attention projections
    "save_attn_mlp_proj": _cp.save_only_these_names(*_QKV, "out_proj", *_MLP),  # every projection
    # the layer inputs (what `full` keeps on the device) go to pinned host memory; the rest is recomputed
    "offload_layer_inputs": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["decoder_layer_input"],
        offload_src="device", offload_dst="pinned_host"),
}


class Block(nnx.Module):
    """x + mixer(norm(x)), then + feed_forward(norm(·)): the mixer and the feed-forward are the
    layer's kinds (maxlite/models/kinds.py; `structure` = (mixer, ffn)). With the family's post-norms
    each branch is normed again before its residual add (Gemma's sandwich); a family without
    pre-norms (OLMo 2/3) norms only there; a kind reading the raw input (`raw_input`: the `none` kinds,
    a MoE that norms its own branches) has no norm before it. Parameter names stay `attn` and `mlp`
    whatever the kinds; each side with a layer part (maxlite/models/sides.py) keeps it under the side's
    name, and its step runs after the feed-forward."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, structure: tuple[str, str] = ("attention", "dense")):
        fam, D = family(cfg), cfg.base_emb_dim
        mixer, ffn = MIXERS[structure[0]], FEED_FORWARDS[structure[1]]
        if fam.pre_norms and not mixer.raw_input:
            self.attn_norm = make_norm(cfg, D, rngs)
        self.attn = mixer.cls()(cfg, rngs=rngs)
        if fam.post_norms:
            self.attn_post_norm = make_norm(cfg, D, rngs)
        if fam.pre_norms and not ffn.raw_input:
            self.mlp_norm = make_norm(cfg, D, rngs)
        self.mlp = ffn.make(cfg, rngs)
        if fam.post_norms:
            self.mlp_post_norm = make_norm(cfg, D, rngs)
        for side in sides(cfg):
            if side.layer:
                setattr(self, side.name, side.load("layer")(cfg, rngs=rngs))
        if cfg.hc_mult:  # hyper-connections: the residual is cfg.hc_mult streams (maxlite/models/hyper.py)
            self.attn_hc = HyperConnection(cfg, rngs=rngs)
            self.mlp_hc = HyperConnection(cfg, rngs=rngs)
        self.finishing = tuple(side for side in sides(cfg) if side.finish)
        self.ffn_sides = tuple(side for side in sides(cfg) if side.ffn_arg) if ffn.side_args else ()
        self.mixer_sides = tuple(side for side in sides(cfg) if side.mixer_arg)
        self.pre_norms, self.post_norms, self.routed = fam.pre_norms, fam.post_norms, ffn.routed
        self.mixer_carries = hasattr(self.attn, "carried")  # it reads or writes the carry's state
        self.ffn_pre_norm = fam.pre_norms and not ffn.raw_input
        self.mixer_pre_norm = fam.pre_norms and not mixer.raw_input
        self.hyper = bool(cfg.hc_mult)

    def mixer_input(self, x_BTD):
        """What the mixer reads: the pre-normed residual (decoding calls it too); with hyper-connections
        the streams' collapse (maxlite/models/hyper.py)."""
        if self.hyper:
            x_BTD = self.attn_hc.collapse(x_BTD)[0]
        return self.attn_norm(x_BTD) if self.mixer_pre_norm else x_BTD

    def add_attention(self, x_BTD, attn_BTD):
        """The residual add of the mixer branch (decoding calls it with its cached attention); with
        hyper-connections spread over the streams, mixed (the weights are those mixer_input's
        collapse used: the same function of the same streams)."""
        attn_BTD = self.attn_post_norm(attn_BTD) if self.post_norms else attn_BTD
        return self.attn_hc.collapse(x_BTD)[1](attn_BTD) if self.hyper else x_BTD + attn_BTD

    def _ffn_input(self, x_BTD):
        return self.mlp_norm(x_BTD) if self.ffn_pre_norm else x_BTD

    def _feed_forward(self, x_BTD, branch):
        """x with the feed-forward branch added: `branch(its input)` → (output, statistics)."""
        add = None
        if self.hyper:
            x_BTD, add = self.mlp_hc.collapse(x_BTD)
        h_BTD, stats = branch(self._ffn_input(x_BTD))
        h_BTD = self.mlp_post_norm(h_BTD) if self.post_norms else h_BTD
        return (add(h_BTD) if self.hyper else x_BTD + h_BTD), stats

    def add_mlp(self, x_BTD, dropout_key=None, inputs: dict | None = None):
        """The feed-forward branch as decoding runs it (a MoE layer dropless); `inputs`: this layer's
        side inputs (a hash-routed layer's token ids)."""
        args = ffn_args(self.ffn_sides, inputs or {})
        return self._feed_forward(x_BTD, lambda h: (self.mlp(h, dropout_key, **args), None))[0]

    def finish(self, x_BTD, carry: Carry):
        """After the feed-forward: the sides' steps (decoding calls it too), each with its part of this
        block and the carry (this layer's inputs)."""
        for side in self.finishing:
            x_BTD = side.load("finish")(getattr(self, side.name, None), x_BTD, carry)
        return x_BTD

    def __call__(self, carry: Carry, positions_BT, segment_ids_BT, dropout_key=None, local=False):
        """(the carry after this layer, the MoE layer's routing statistics or None). With
        hyper-connections the carry's hidden states are the residual's streams [B, T, N, D]."""
        x_BTD, state = carry.x_BTD, carry.state
        key_attn, key_mlp = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        if self.mixer_carries:
            mixed, state = self.attn.carried(self.mixer_input(x_BTD), state, positions_BT, segment_ids_BT, key_attn,
                                             local, **mixer_args(self.mixer_sides, carry.inputs))
        else:
            mixed = self.attn(self.mixer_input(x_BTD), positions_BT, segment_ids_BT, key_attn, local,
                              **mixer_args(self.mixer_sides, carry.inputs))
        x_BTD = self.add_attention(x_BTD, mixed)
        args = ffn_args(self.ffn_sides, carry.inputs)
        if not self.routed:
            x_BTD = self.add_mlp(x_BTD, key_mlp, carry.inputs)
            stats = None
        else:
            x_BTD, stats = self._feed_forward(x_BTD, lambda h: self.mlp.routed(h, segment_ids_BT, key_mlp, **args))
        carry = carry.replace(state=state)
        return carry.replace(x_BTD=constrain(self.finish(x_BTD, carry), STREAMS if self.hyper else BTD)), stats


class Unit(nnx.Module):
    """Consecutive layers scanned as one step (a repeating block: interleaved dense and MoE layers,
    or mixers of several kinds)."""

    def __init__(self, cfg, structures: tuple[tuple[str, str], ...], keys):
        self.blocks = nnx.List([Block(cfg, rngs=nnx.Rngs(params=key), structure=s)
                                for s, key in zip(structures, keys)])

    def __call__(self, carry: Carry, positions_BT, segment_ids_BT, dropout_keys=None, local=False, each=None):
        """(the carry, the MoE layers' statistics stacked [m, ...] or None); `dropout_keys`, `local` (a
        bool, or one flag per layer) and the carry's inputs ([m, ...]) are the unit's layers'. `each(flag)`:
        the function that runs one layer, (carry, block, positions, segment ids, key) → (carry, statistics),
        under its own remat (Transformer._run_layers: a stack of one unit); the block itself if None."""
        stats, inputs = [], carry.inputs
        for j, block in enumerate(self.blocks):
            key = None if dropout_keys is None else dropout_keys[j]
            flag = local if isinstance(local, bool) else local[j]
            layer_in = carry.with_inputs(jax.tree.map(lambda a, j=j: a[j], inputs))
            if each is None:
                carry, s = block(layer_in, positions_BT, segment_ids_BT, key, flag)
            else:
                carry, s = each(flag)(layer_in, block, positions_BT, segment_ids_BT, key)
            if s is not None:
                stats.append(s)
        return carry.with_inputs(inputs), (jax.tree.map(lambda *a: jnp.stack(a), *stats) if stats else None)


class MTPLayer(nnx.Module):
    """One multi-token-prediction depth (DeepSeek-V3): the previous depth's hidden state and the
    embedding of the token k ahead, each RMS-normed, concatenated [embedding; hidden] and projected
    back to D, through one decoder layer of the model's last layer's kinds, then its own final norm
    (the output head is the model's). maxlite/models/mtp.py runs the depths and their losses."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, wd = cfg.base_emb_dim, jnp.dtype(cfg.weight_dtype)
        last = layer_kinds(cfg)[-1]
        self.enorm = make_norm(cfg, D, rngs)
        self.hnorm = make_norm(cfg, D, rngs)
        self.eh_proj = param(rngs, (2 * D, D), (None, "embed"), wd, scale=cfg.init_scale)
        self.block = Block(cfg, rngs=rngs, structure=(last.mixer, last.ffn))
        self.norm = make_norm(cfg, D, rngs)

    def __call__(self, h_BTD, emb_BTD, positions_BT, segment_ids_BT):
        """(hidden state h_BTD, its normed output, its MoE layer's routing statistics or None)."""
        x_BTD = matmul.project("btc,cd->btd", jnp.concatenate([self.enorm(emb_BTD), self.hnorm(h_BTD)], axis=-1),
                               self.eh_proj[...])
        carry, stats = self.block(Carry(constrain(x_BTD, BTD)), positions_BT, segment_ids_BT)
        return carry.x_BTD, self.norm(carry.x_BTD), stats


class Transformer(nnx.Module):
    """inputs_BT, positions_BT, segment_ids_BT → logits_BTV (float32). `dropout_key` (training
    with lora_dropout > 0 only) gives each layer its own key for the adapters' dropout."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        D, V, wd = cfg.base_emb_dim, cfg.vocab_size, jnp.dtype(cfg.weight_dtype)
        self.cfg = cfg
        self.embedding = param(rngs, (V, D), ("vocab", "embed"), wd, scale=cfg.init_scale)
        if family(cfg).positions == "learned":
            self.positions = param(rngs, (cfg.max_position_embeddings, D), ("position", "embed"), wd,
                                   scale=cfg.init_scale)
        stacks, kinds = layer_stacks(cfg), layer_kinds(cfg)
        if cfg.scan_layers and len(stacks) == 1 and len(stacks[0].unit) == 1:  # one stack of like layers
            @nnx.split_rngs(splits=cfg.base_num_decoder_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_stack(rngs):
                return Block(cfg, rngs=rngs, structure=stacks[0].unit[0])
            self.layers = make_stack(rngs)
        else:
            # The same per-layer keys as the scanned stack: one seed gives one model either way.
            keys = nnx.split_rngs(rngs, splits=cfg.base_num_decoder_layers,
                                  graph_updates=False).params.key[...]
            if not cfg.scan_layers:
                self.layers = nnx.List([Block(cfg, rngs=nnx.Rngs(params=key), structure=(k.mixer, k.ffn))
                                        for key, k in zip(keys, kinds)])
            for stack in stacks if cfg.scan_layers else ():
                n = len(stack.unit)
                unit_keys = keys[stack.first:stack.first + stack.count * n].reshape(stack.count, n)

                setattr(self, stack.name, _stack_maker(cfg, stack.unit)(unit_keys))
        for side in sides(cfg):
            if side.model:
                setattr(self, side.name, side.load("model")(cfg, rngs=rngs))
        if cfg.hc_mult:  # the streams collapsed before the final norm
            self.hc_head = HyperHead(cfg, rngs=rngs)
        self.final_norm = make_norm(cfg, D, rngs)
        if cfg.mtp_num_layers:  # training only: decoding never runs them
            self.mtp = nnx.List([MTPLayer(cfg, rngs=rngs) for _ in range(cfg.mtp_num_layers)])
        if not cfg.logits_via_embedding:
            self.unembedding = param(rngs, (D, V), ("embed", "vocab"), wd, scale=cfg.init_scale)
        if cfg.vision_encoder:  # last: a text model's parameters draw the same random numbers either way
            self.vision = towers.build(cfg, rngs)
        if cfg.index_stage == "dense_warmup":
            from maxlite.models.dsa import freeze_all_but_the_indexers

            freeze_all_but_the_indexers(self)

    def _run_layers(self, x_BTD, positions_BT, segment_ids_BT, dropout_key=None, inputs_L=None):
        """(x_BTD, the MoE layers' routing statistics stacked in layer order [L_moe, ...] or None).
        Each layer's `local` flag: a Python bool for unrolled layers and for a stack whose layers
        are alike, else an array scanned with the layers; its inputs (`inputs_L`: side name → [L, ...],
        carry.layer_inputs) are scanned with it. The layers pass one Carry (carry.start: the hidden
        states and the sides' state)."""
        cfg = self.cfg
        keys_L = None if dropout_key is None else jax.random.split(dropout_key, cfg.base_num_decoder_layers)
        inputs_L = inputs_L or {}
        local = tuple(w > 0 for w in layer_windows(cfg))
        carry = start(cfg, x_BTD)

        def block_fn(carry, layer, positions, segment_ids, key, inputs, local):
            carry = carry.replace(x_BTD=checkpoint_name(carry.x_BTD, "decoder_layer_input"), inputs=inputs or {})
            carry, stats = layer(carry, positions, segment_ids, key, local)
            return carry.without_inputs(), stats

        def static(flag: bool):  # the flag bound as a constant (NNX transforms take positions only)
            return lambda carry, layer, positions, segment_ids, key, inputs: block_fn(
                carry, layer, positions, segment_ids, key, inputs, flag)

        def remat(fn, prevent_cse=not cfg.scan_layers):
            if cfg.remat_policy == "none":
                return fn
            return nnx.remat(fn, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=prevent_cse)

        def one_unit(flag: bool | None):
            """The step of a stack that is one unit of several layers (a pattern with no shorter period:
            Nemotron-H's 52 layers), each layer under its own remat that keeps common subexpressions
            apart: XLA inlines a scan of one step, so the forward pass and the backward's recomputation
            meet in one program, where a whole-unit remat (or one without prevent_cse) would keep every
            layer's activations alive, as if there were no remat (Nemotron-H-8B on v6e:2x4 at 8,192
            tokens: 62.41 GiB of temporaries; 28.67 GiB peak so). `flag`: the layers' static local flag,
            or None (then one flag per layer is the step's last argument)."""
            def step(carry, unit, positions, segment_ids, key, inputs, local=flag):
                def each(f):
                    if isinstance(f, bool):  # bound as a constant, as `static` does
                        return remat(lambda c, b, p, s, k: block_fn(c, b, p, s, k, c.inputs, f), True)
                    run = remat(lambda c, b, p, s, k, f: block_fn(c, b, p, s, k, c.inputs, f), True)
                    return lambda c, b, p, s, k: run(c, b, p, s, k, f)
                carry, stats = unit(carry.replace(inputs=inputs or {}), positions, segment_ids, key, local, each=each)
                return carry.without_inputs(), stats
            if flag is None:
                return step
            return lambda carry, unit, positions, segment_ids, key, inputs: step(carry, unit, positions, segment_ids,
                                                                               key, inputs)

        stats = []
        if not cfg.scan_layers:  # a static flag per layer
            for i, layer in enumerate(self.layers):
                fn = remat(static(local[i]))
                carry, s = fn(carry, layer, positions_BT, segment_ids_BT, None if keys_L is None else keys_L[i],
                              jax.tree.map(lambda a, i=i: a[i], inputs_L))
                stats += [] if s is None else [jax.tree.map(lambda a: a[None], s)]
            return carry.x_BTD, _concat(stats)
        if pipeline.num_stages(cfg) > 1:  # the one stack, split into pipeline stages
            # recipe validation refuses sides that travel between layers (config_checks._check_pipeline)
            assert not carry.state and not inputs_L, "the pipeline carries the hidden states only"
            return pipeline.run(cfg, self.layers, carry.x_BTD, positions_BT, segment_ids_BT, local,
                                None if cfg.remat_policy == "none" else REMAT_POLICIES[cfg.remat_policy])
        for stack in layer_stacks(cfg):
            n = len(stack.unit)
            span = slice(stack.first, stack.first + stack.count * n)
            keys = None if keys_L is None else keys_L[span].reshape((stack.count, n)[:1 if n == 1 else 2])
            key_axis = None if keys is None else 0
            inputs = jax.tree.map(lambda a: a[span].reshape(stack.count, *((n,) if n > 1 else ()), *a.shape[1:]),
                                  inputs_L)
            inputs_axis = 0 if inputs else None
            flags = local[span]
            if len(set(flags)) == 1:  # every layer alike: the flag is static
                once = stack.count == 1  # a scan of one step, inlined: see one_unit
                step = one_unit(flags[0]) if once and n > 1 else remat(static(flags[0]), once)
                scan_fn = nnx.scan(step, in_axes=(nnx.Carry, 0, None, None, key_axis, inputs_axis),
                                   out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
                carry, s = scan_fn(carry, getattr(self, stack.name), positions_BT, segment_ids_BT, keys,
                                   inputs or None)
            else:
                flags_arr = jnp.asarray(flags).reshape((stack.count, n)[:1 if n == 1 else 2])
                once = stack.count == 1
                scan_fn = nnx.scan(one_unit(None) if once and n > 1 else remat(block_fn, once),
                                   in_axes=(nnx.Carry, 0, None, None, key_axis, inputs_axis, 0),
                                   out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
                carry, s = scan_fn(carry, getattr(self, stack.name), positions_BT, segment_ids_BT, keys,
                                   inputs or None, flags_arr)
            if s is not None:  # [count, ...], or [count, m, ...] for units of several layers
                stats.append(s if n == 1 else jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), s))
        return carry.x_BTD, _concat(stats)

    def blocks(self) -> list:
        """The layers one by one, in order (scanned stacks sliced per layer): what decoding walks."""
        if not self.cfg.scan_layers:
            return list(self.layers)
        out = []
        for i in range(self.cfg.base_num_decoder_layers):
            path, index = layer_place(self.cfg, i)
            module = self
            for key in path:
                module = getattr(module, key) if isinstance(key, str) else module[key]
            graphdef, state = nnx.split(module)
            out.append(nnx.merge(graphdef, jax.tree.map(lambda x, i=index: x[i], state)))
        return out

    def embed(self, inputs_BT, positions_BT):
        """Token embeddings (× √D when the family scales them; + learned positions) in the compute dtype."""
        dt = jnp.dtype(self.cfg.dtype)
        x_BTD = jnp.take(self.embedding[...], inputs_BT, axis=0).astype(dt)
        if family(self.cfg).embed_scale:
            x_BTD = x_BTD * jnp.asarray(math.sqrt(self.cfg.base_emb_dim), dt)
        if family(self.cfg).positions == "learned":
            x_BTD = x_BTD + jnp.take(self.positions[...], positions_BT, axis=0).astype(dt)
        return constrain(x_BTD, BTD)

    def embed_prompt(self, inputs_BT, positions_BT, images: dict | None = None):
        """(the embedded tokens with each image's tokens in its placeholders' places, what the layers'
        sides read from the images: maxlite/models/vision/merge.py). `images`: the batch's image
        arrays (the encoder kind's), or None for text only. Positions are [B, T], or [B, T, 3]
        (time, height, width) with multimodal RoPE (`mrope_sections`)."""
        x_BTD = self.embed(inputs_BT, positions_BT if positions_BT.ndim == 2 else positions_BT[..., 0])
        if images is None:
            return x_BTD, {}
        return merge(self, inputs_BT, x_BTD, images)

    def forward(self, inputs_BT, positions_BT, segment_ids_BT, dropout_key=None, images: dict | None = None):
        """(the final-normed hidden states x_BTD, the MoE layers' routing statistics stacked
        [L_moe, ...] or None: maxlite.models.moe.aux_losses turns them into losses and metrics)."""
        with pipeline.feeding(self.cfg):  # with stages: the rows every stage holds, not split over `stage`
            x_BTD, seen = self.embed_prompt(inputs_BT, positions_BT, images)
        with matmul.quantization(self.cfg.quantization):  # the model's own mode, while its layers trace
            inputs_L = layer_inputs(self, inputs_BT, x_BTD, seen)
            x_BTD, stats = self._run_layers(self.streams_in(x_BTD), positions_BT, segment_ids_BT, dropout_key,
                                            inputs_L)
        return self.final_norm(self.streams_out(x_BTD)), stats

    def streams_in(self, x_BTD):
        """What the first layer reads: the embeddings, copied into each stream with hyper-connections."""
        return expand(self.cfg, x_BTD) if self.cfg.hc_mult else x_BTD

    def streams_out(self, x_BTD):
        """What the final norm reads: the last layer's output, its streams collapsed by the head."""
        return self.hc_head(x_BTD) if self.cfg.hc_mult else x_BTD

    def hidden(self, inputs_BT, positions_BT, segment_ids_BT, dropout_key=None, images: dict | None = None):
        """The final-normed hidden states x_BTD (what the output head multiplies)."""
        return self.forward(inputs_BT, positions_BT, segment_ids_BT, dropout_key, images)[0]

    def head(self) -> tuple[str, jax.Array]:
        """The output head as stored, with its einsum operand spec: the embedding table [V, D]
        ("vd") when tied, else the unembedding [D, V] ("dv"). Every product with the head (the
        logits below, the chunked loss, decoding) names the table in its stored layout: through a
        transpose, its gradient would be a transposed bf16 × bf16 → f32 dot, which XLA's CPU dot
        cannot compute (UNIMPLEMENTED: DotThunk BF16 x BF16 = F32). The rollout engine's copy of an
        untied head is held as the compute dtype's bits on a CPU (maxlite/rollout/weights.py): read as
        that dtype."""
        if self.cfg.logits_via_embedding:
            return "vd", self.embedding[...]
        return "dv", cache_bits.load(self.unembedding[...], jnp.dtype(self.cfg.dtype))

    def logits(self, x_BTD):
        """logits_BTV (float32) of final-normed hidden states; `project` casts the stored head
        itself and on CPU returns its gradient in its own dtype."""
        spec, w = self.head()
        logits_BTV = matmul.project(f"btd,{spec}->btv", x_BTD, w).astype(jnp.float32)
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits_BTV = cap * jnp.tanh(logits_BTV / cap)
        return constrain(logits_BTV, ("activation_batch", "activation_length", "activation_vocab"))

    def __call__(self, inputs_BT, positions_BT, segment_ids_BT, dropout_key=None, images: dict | None = None):
        return self.logits(self.hidden(inputs_BT, positions_BT, segment_ids_BT, dropout_key, images))


def _stack_maker(cfg, unit: tuple[str, ...]):
    """A function of the per-unit keys [count, len(unit)] that creates a stack of units."""
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make(keys):
        if len(unit) == 1:
            return Block(cfg, rngs=nnx.Rngs(params=keys[0]), structure=unit[0])
        return Unit(cfg, unit, keys)
    return make


def _concat(stats: list):
    """Per-stack statistics [n_i, ...] → one stack in layer order; None for a dense model."""
    return jax.tree.map(lambda *a: jnp.concatenate(a), *stats) if stats else None
