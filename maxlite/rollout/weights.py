"""The rollout engine's copy of the decoder layers' weights and of an untied output head, held in the
compute dtype (as vLLM holds a model's weights), not as the trainer's float32 masters.

Every product of a layer weight with the hidden states casts the weight to the compute dtype first
(maxlite/models/matmul.py `project`): a decode step on float32 masters re-rounds every layer weight to
bfloat16 each step (llama-100m, 32 slots: 43 of an 87 ms forward). Held rounded once per push, the
step reads them as they are. Only weights whose every use in a layer is that cast are held so
(`held_paths`, read from the model's traced forward): the same values reach every product, so the
engine samples the same tokens with the same log-probs as when each step rounded the masters, bit for
bit; a weight used otherwise (the delta-net's A_log in float32, a norm's scale) keeps its stored form.

On a CPU the held weights are the bfloat16 bits as uint16 (maxlite/models/cache_bits.py: XLA:CPU
slices a bfloat16 stack inside the layers' loop through a float32 copy of the whole stack); a layer
views them as the compute dtype before it runs (cache_bits.viewed, which maxlite/models/decode.py
calls on each layer), and the head is read so (Transformer.head). Other platforms hold bfloat16
itself, half the bytes of the masters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxlite.models.cache_bits import store, stored
from maxlite.models.layout import layer_stacks


def _sub_jaxprs(eqn):
    """(sub-jaxpr, offset) pairs whose invars are the eqn's operands from `offset` on, 1 : 1 (calls,
    custom derivatives, remat, scan, each branch of a cond); None where the operands do not map
    that way (a while loop)."""
    p, name = eqn.params, eqn.primitive.name
    if name == "cond":
        return [(b.jaxpr, 1) for b in p["branches"]]
    if name == "while":
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = p.get(key)
        if sub is not None:
            return [(sub.jaxpr if hasattr(sub, "jaxpr") else sub, 0)]
    return []


def _uses(jaxpr, var, dtype) -> tuple[bool, list[int]]:
    """(whether every use of `var` in `jaxpr` casts it to `dtype`, following it into the calls it is
    passed to and out of those that hand it back unchanged, the indices of `jaxpr`'s outputs it
    leaves as: NNX's transforms return the module's state, weights included, from a scan or a remat)."""
    outs = [i for i, v in enumerate(jaxpr.outvars) if v is var]
    for eqn in jaxpr.eqns:
        for k, operand in enumerate(eqn.invars):
            if operand is not var:
                continue
            if eqn.primitive.name == "convert_element_type" and jnp.dtype(eqn.params["new_dtype"]) == dtype:
                continue
            for sub, off in _sub_jaxprs(eqn) or [(None, 0)]:
                if sub is None or not 0 <= k - off < len(sub.invars):
                    return False, []
                ok, returned = _uses(sub, sub.invars[k - off], dtype)
                if not ok:
                    return False, []
                for i in returned:  # the same value, out of the call: its uses here count too
                    ok, further = _uses(jaxpr, eqn.outvars[i], dtype)
                    if not ok:
                        return False, []
                    outs += further
    return True, outs


def _only_cast(jaxpr, var, dtype) -> bool:
    """Whether every use of the program's input `var` casts it to `dtype` (none returns it as it is)."""
    ok, outs = _uses(jaxpr, var, dtype)
    return ok and not outs


def held_paths(cfg, graphdef, params) -> frozenset[tuple]:
    """The paths (nnx.State keys) of the decoder layers' floating weights and of an untied output head
    whose every use in the model's forward casts them to the compute dtype: read from the jaxpr of a
    forward over one short row (the embedding, a head tied to it — gathered, not cast — and the
    multi-token-prediction depths stay as stored)."""
    dtype = jnp.dtype(cfg.dtype)
    flat = [(tuple(path), leaf) for path, leaf in nnx.to_flat_state(params)]
    if not any(jnp.issubdtype(v.get_value().dtype, jnp.floating) and v.get_value().dtype != dtype
               for _, v in flat):
        return frozenset()  # float32 compute, or weights already in the compute dtype: nothing to hold

    def forward(values):
        state = nnx.from_flat_state([(p, v.replace(x)) for (p, v), x in zip(flat, values)])
        model = nnx.merge(graphdef, state)
        T = 8
        ids = jnp.zeros((1, T), jnp.int32)
        return model(ids, jnp.arange(T)[None], jnp.ones((1, T), jnp.int32))

    closed = jax.make_jaxpr(forward)([jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype)
                                      for _, v in flat])
    # the decoder layers' parts, and the head (its 32 × V product casts it: llama-100m, 3.8 ms a step)
    stacks = {"layers", "unembedding", *(stack.name for stack in layer_stacks(cfg))}
    return frozenset(path for (path, v), var in zip(flat, closed.jaxpr.invars)
                     if path[0] in stacks and jnp.issubdtype(v.get_value().dtype, jnp.floating)
                     and v.get_value().dtype != dtype and _only_cast(closed.jaxpr, var, dtype))


def held(cfg, paths: frozenset[tuple], params):
    """`params` with the weights at `paths` rounded to the compute dtype (on a CPU: its bits)."""
    dtype = jnp.dtype(cfg.dtype)
    as_held = stored(dtype)
    flat = nnx.to_flat_state(params)
    return nnx.from_flat_state([(path, v.replace(store(v.get_value(), as_held, dtype)) if tuple(path) in paths
                                 else v) for path, v in flat])
