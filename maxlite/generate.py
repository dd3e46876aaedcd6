"""Sample text from a trained model with a KV cache: `python -m maxlite.generate RUN_DIR_OR_CHECKPOINT
--prompt "..."`, or from Python.

    python -m maxlite.generate runs/demo --prompt "And God said" --max-new-tokens 40
    python -m maxlite.generate ckpt/ --prompts-file prompts.jsonl --temperature 0.8 --top-p 0.9
    python -m maxlite.generate ckpt/ dtype=float32 attention=dot_product --prompt "..."   # key=value overrides

The source is a run directory (its checkpoints/), a checkpoint directory, or one step of it — also
what `python -m maxlite.bridge.hf import` writes (the imported model keeps its HF tokenizer). The
params are sharded onto the recipe's mesh over this host's devices; the prompts decode in one batch
(right-padded; models/decode.py); each output stops at the tokenizer's end-of-text id. Texts go to
stdout, a tokens/s line to stderr.

    from maxlite.generate import generate
    texts = generate(cfg, params, ["And God said"], max_new_tokens=20)   # greedy by default
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from typing import Any, Sequence

import numpy as np

from maxlite import cli, config as C, mesh as mesh_lib


@dataclasses.dataclass
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1: no cut
    seed: int = 0

    def check(self) -> "Sampling":
        if self.max_new_tokens < 1:
            raise C.ConfigError(f"max_new_tokens={self.max_new_tokens} must be at least 1")
        from maxlite.models.decode import sampling_refusal

        if (why := sampling_refusal(self.temperature, self.top_k, self.top_p)) is not None:
            raise C.ConfigError(why)
        return self


@dataclasses.dataclass
class Generated:
    tokens: list[list[int]]  # new tokens per prompt, up to (not including) the end-of-text id
    seconds: float  # decoding, compile excluded
    compile_seconds: float
    steps: int  # decode steps run (the loop ends when every row has ended)
    cache_bytes_per_token: float = 0.0  # the decode cache per position of the longest row, every layer
    cache_state_bytes: float = 0.0  # of that row's cache, the recurrent layers' state: the same at any length
    cache_positions: int = 0  # what each layer's cache was sized for: the longest prompt + max_new_tokens
    prompts: list[list[int]] | None = None  # with images: the prompts as decoded, placeholders expanded

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.tokens)) / max(self.seconds, 1e-9)


_compiled: dict = {}  # (graphdef, shapes, sampling) → compiled function, reused by a training hook


def generate_ids(cfg, params, prompts: Sequence[Sequence[int]], sampling: Sampling = Sampling(),
                 eos_id: int | None = None, mesh=None, images: Sequence[Sequence[Any]] | None = None) -> Generated:
    """New token ids for each prompt (lists of ids). `params`: an nnx.State (host arrays, or global
    arrays already sharded, e.g. a TrainState's `.params` on the training `mesh`). With several
    processes every one of them must call this, with the same prompts. `images`: each prompt's
    images (PIL), one image placeholder token per image in its ids (a vision model only)."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from maxlite.models import decode
    from maxlite.state import abstract_params

    sampling.check()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise C.ConfigError("every prompt needs at least one token")
    vision = None
    if images is not None and any(images):
        prompts, vision = _with_images(cfg, prompts, images)
    lengths = np.array([len(p) for p in prompts], np.int32)
    P = int(lengths.max())
    if P + sampling.max_new_tokens > cfg.max_position_embeddings:
        raise C.ConfigError(f"prompt ({P} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds "
                            f"the model's max_position_embeddings={cfg.max_position_embeddings}")
    shards = mesh.shape[mesh_lib.LENGTH_AXIS] if mesh is not None else 1  # a long prompt split over context
    prompt = np.zeros((len(prompts), decode.prompt_length(cfg, P, shards)), np.int32)
    for row, ids in zip(prompt, prompts):
        row[:len(ids)] = ids
    graphdef, _ = abstract_params(cfg)
    eos = -1 if eos_id is None else int(eos_id)
    if vision is not None and "rope" in vision:  # [B, P, 3] positions, padded like the prompt
        vision["rope"] = np.pad(vision["rope"], ((0, 0), (0, prompt.shape[1] - vision["rope"].shape[1]), (0, 0)))
    args = (params, prompt, lengths, jax.random.key(sampling.seed), vision)
    if mesh is not None:  # the same value on every process: replicated global arrays
        replicated = NamedSharding(mesh, PartitionSpec())
        args = (params, *(jax.device_put(a, replicated) for a in args[1:3]), args[3],
                jax.device_put(vision, replicated) if vision is not None else None)
    static = (sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p, eos)
    shapes = jax.tree.map(np.shape, vision)
    key = (repr(cfg), prompt.shape, static, id(mesh), repr(shapes))
    start = time.perf_counter()
    if key not in _compiled:
        fn = jax.jit(lambda p, x, n, k, v: decode.generate_tokens(
            graphdef, p, x, n, k, v, max_new_tokens=static[0], temperature=static[1], top_k=static[2],
            top_p=static[3], eos_id=static[4]))
        # the training rules but for the batch: a few prompts are not split over the data axes
        with contextlib.ExitStack() as ctx:
            if mesh is not None:
                ctx.enter_context(jax.set_mesh(mesh))
            ctx.enter_context(nnx.logical_axis_rules(mesh_lib.DECODE_RULES))
            _compiled[key] = fn.lower(*args).compile()
    compiled = start_run = time.perf_counter()
    out, steps = _compiled[key](*args)
    out = np.asarray(out.addressable_data(0) if mesh is not None else out)
    steps = int(np.asarray(steps.addressable_data(0) if mesh is not None else steps))
    seconds = time.perf_counter() - start_run
    tokens = []
    for row in out.tolist():
        tokens.append(row[:row.index(eos)] if eos in row else row)
    from maxlite.models.kinds import decode_cache_numbers
    length = P + sampling.max_new_tokens  # what each layer's cache was sized for
    itemsize = np.dtype(jax.numpy.dtype(cfg.dtype)).itemsize
    total, state = decode_cache_numbers(cfg, length)
    return Generated(tokens, seconds, compiled - start, steps, total * itemsize / length, state * itemsize, length,
                     prompts if vision is not None else None)


def cache_line(got: Generated) -> str:
    """The decode cache of the longest row, in words: per token, and the recurrent layers' state of
    fixed size apart (a hybrid's delta-net or Mamba-2 layers hold the same bytes at any length)."""
    line = f"decode cache {got.cache_bytes_per_token:,.0f} bytes per token"
    if not got.cache_state_bytes:
        return line
    growing = got.cache_bytes_per_token * got.cache_positions - got.cache_state_bytes
    return (f"decode cache {growing / got.cache_positions:,.0f} bytes per token + a recurrent state of "
            f"{got.cache_state_bytes:,.0f} bytes per sequence at any length")


def _with_images(cfg, prompts, images) -> tuple[list[list[int]], dict]:
    """(the prompts with each image placeholder expanded to its image's tokens, {"images": the batch's
    image arrays, "rope": [B, P, 3] multimodal positions where the kind has them}): data/image_docs.py's
    rule, as SFT data. The image arrays are padded to the batch's most (patches, or images)."""
    from maxlite.data import image_docs

    if not cfg.vision_encoder:
        raise C.ConfigError("images given, but this model has no vision encoder (vision_encoder is empty)")
    kind = image_docs.kind_of(cfg)
    docs = [image_docs.doc_arrays(kind, np.asarray(p, np.int32), np.zeros(len(p), bool), imgs, f"prompt {i}")
            for i, (p, imgs) in enumerate(zip(prompts, images))]
    width = max(len(d[0]) for d in docs)
    rows = max(1, max(len(d[3]["image_pixels"]) for d in docs))
    rows = -(-rows // kind.ROW_MULTIPLE) * kind.ROW_MULTIPLE
    arrays = {k: np.stack([np.pad(d[3][k], [(0, rows - len(d[3][k]))] + [(0, 0)] * (d[3][k].ndim - 1),
                                  constant_values=kind.PAD_VALUES.get(k, 0)) for d in docs]) for k in kind.ROW_KEYS}
    vision = {"images": arrays}
    if docs[0][2] is not None:
        vision["rope"] = np.stack([np.pad(d[2], ((0, width - len(d[2])), (0, 0))) for d in docs])
    return [d[0].tolist() for d in docs], vision


def generate(cfg, params, prompts: Sequence[str], tokenizer=None, sampling: Sampling | None = None,
             mesh=None, **kwargs) -> list[str]:
    """Continuations of text prompts (the model's tokenizer unless one is given); keyword arguments
    are `Sampling` fields."""
    texts, _ = generate_text(cfg, params, prompts, tokenizer, sampling or Sampling(**kwargs), mesh)
    return texts


def generate_text(cfg, params, prompts: Sequence[str], tokenizer=None, sampling: Sampling = Sampling(),
                  mesh=None, chat: bool = False, images: Sequence[Sequence[Any]] | None = None
                  ) -> tuple[list[str], Generated]:
    """`chat`: each prompt is a user turn, rendered with the model's chat template (data/chat.py,
    `sft_template`) and the assistant's generation prompt, as an SFT run trained it. `images`: each
    prompt's images (PIL), which come before its text: in the chat turn as image parts (the template
    writes their placeholders), else as the vision markers around one placeholder each."""
    from maxlite.data.tokenizer import load_tokenizer

    tok = tokenizer or load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id)
    images = images if images is not None and any(images) else None
    if images is not None and not cfg.vision_encoder:
        raise C.ConfigError("--image given, but this model has no vision encoder (vision_encoder is empty)")
    from maxlite.data import image_docs

    expansion = image_docs.text_expansion(cfg, tok) if images is not None else None
    if chat:
        from maxlite.data.chat import ChatTemplate
        template = ChatTemplate.for_config(cfg, tok)

        def turn(p, pictures):
            return p if not pictures else [*({"type": "image", "image": ""} for _ in pictures),
                                           {"type": "text", "text": p}]
        ids = [template.prompt_ids([{"role": "user", "content": turn(p, pictures)}])
               for p, pictures in zip(prompts, images or [()] * len(prompts))]
    elif expansion is not None:  # the kind expands in the text: one start-of-image text per image, first
        ids = [list(tok.encode(image_docs.expand_text(expansion[0] * len(pictures) + p, [], expansion)[0]))
               for p, pictures in zip(prompts, images or [()] * len(prompts))]
    else:
        marks = [getattr(cfg, key) for key in image_docs.kind_of(cfg).PROMPT_MARKS] if images is not None else []
        ids = [[*(m for _ in pictures for m in marks if m >= 0), *tok.encode(p)]
               for p, pictures in zip(prompts, images or [()] * len(prompts))]
    if cfg.add_bos and tok.bos_id is not None and not chat:
        ids = [[tok.bos_id, *x] for x in ids]
    eos = tok.eos_id
    if chat:  # the answer ends at the end of its turn (<|im_end|>), which the tokenizer's eos may not be
        end = tok._backend.token_to_id(template.eos_token) if template.eos_token and hasattr(
            tok._backend, "token_to_id") else None
        eos = end if end is not None else eos
    got = generate_ids(cfg, params, ids, sampling, eos, mesh, images)
    ids = got.prompts or ids  # with images: the placeholders expanded, as the model saw them
    texts = [_continuation(tok, p, t) for p, t in zip(ids, got.tokens)]
    if chat:  # the answer ends at the end of its turn, a token or (in a tokenizer without it) a text
        ends = [e for e in (template.eos_token, "<|im_end|>", "<|eot_id|>") if e]
        texts = [min((t.split(e)[0] for e in ends), key=len) for t in texts]
    return texts, got


def _continuation(tok, prompt: list[int], new: list[int]) -> str:
    """The text the new tokens add to the prompt's, spaces between them included (as HF pipelines
    do: decode prompt + new, drop the prompt's own decoding)."""
    head, whole = tok.decode(prompt), tok.decode([*prompt, *new])
    return whole[len(head):] if whole.startswith(head) else tok.decode(new)


def load(source: str, step: int | None = None, overrides: Sequence[str] = ()):
    """(cfg, params sharded onto the recipe's mesh over this host's devices, mesh) from a run
    directory, a checkpoint directory or a step directory; `overrides` (key=value, as every entry
    point takes them) change the saved recipe, e.g. dtype=float32 to compute in float32."""
    import fsspec
    import jax

    from maxlite import checkpoints as ck
    from maxlite.build import build

    source = C.resolve_path(source).rstrip("/")
    fs = fsspec.url_to_fs(source)[0]
    if not fs.exists(source):
        raise C.ConfigError(f"{source}: no such run or checkpoint directory")
    if fs.exists(f"{source}/checkpoints"):
        source = f"{source}/checkpoints"
    cfg, params = ck.load_params(source, step=step)
    if overrides:  # key=value above the saved recipe, validated as a recipe is
        cfg = C.load(list(overrides), **C.to_plain_dict(cfg))
    # this host's devices, whatever mesh the model trained on: weights sharded fsdp-style over all
    # (a context axis only where the overrides ask for one: it splits a long prompt's prefill)
    context = cfg.ici_context_parallelism if any(o.startswith("ici_context_parallelism=") for o in overrides) else 1
    cfg = dataclasses.replace(cfg, ici_data_parallelism=1, ici_fsdp_parallelism=-1, ici_tensor_parallelism=1,
                              ici_context_parallelism=context, dcn_context_parallelism=1,
                              dcn_data_parallelism=-1, dcn_fsdp_parallelism=1, dcn_tensor_parallelism=1,
                              ici_pipeline_parallelism=1, dcn_pipeline_parallelism=1,  # decoding has no stages
                              num_slices=-1, per_device_batch_size=1, gradient_accumulation_steps=1)
    built = build(cfg, jax.local_devices(), num_processes=1)
    leaves = [jax.device_put(x, s) for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(built.shardings.params))]
    return built.cfg, jax.tree.unflatten(jax.tree.structure(params), leaves), built.mesh


def _prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    prompts = []
    with open(C.resolve_path(args.prompts_file)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompts.append(record["prompt"] if isinstance(record, dict) else str(record))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise C.ConfigError(f"{args.prompts_file}:{n}: not a JSON object with a \"prompt\" field") from None
    if not prompts:
        raise C.ConfigError(f"{args.prompts_file}: no prompts in it")
    return prompts


@cli.entry_point(FileNotFoundError)
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m maxlite.generate", description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("source", help="a run directory, a checkpoint directory or one step of it")
    ap.add_argument("overrides", nargs="*", help="key=value changes to the saved recipe (dtype=float32, ...)")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt")
    which.add_argument("--prompts-file", help="jsonl: one {\"prompt\": ...} per line, decoded as one batch")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ap.add_argument("--chat", action="store_true",
                    help="each prompt is a user turn in the model's chat template (models fine-tuned with dataset_type=sft)")
    ap.add_argument("--image", action="append", default=[], metavar="PATH",
                    help="an image for the prompt (repeat for several; a vision model): encoded once, before the text")
    args = ap.parse_intermixed_args(argv)  # key=value overrides before or after the options
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed).check()
    prompts = _prompts(args)
    pictures = None
    if args.image:
        from maxlite.data.images import load_image
        if len(prompts) > 1:
            raise C.ConfigError("--image goes with --prompt (one prompt), not --prompts-file")
        pictures = [[load_image(path, base_dir=".", where=f"--image {path}") for path in args.image]]
    cfg, params, mesh = load(args.source, args.step, args.overrides)
    texts, got = generate_text(cfg, params, prompts, None, sampling, mesh, chat=args.chat, images=pictures)
    for prompt, text in zip(prompts, texts):
        print(json.dumps({"prompt": prompt, "completion": text}, ensure_ascii=False) if len(prompts) > 1
              else prompt + text, flush=True)
    n = sum(map(len, got.tokens))
    print(f"maxlite: generated {n} tokens for {len(prompts)} prompt(s) in {got.seconds:.2f} s "
          f"({got.tokens_per_second:,.1f} tokens/s; {got.steps} decode steps; compiled in "
          f"{got.compile_seconds:.1f} s; {cache_line(got)})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
