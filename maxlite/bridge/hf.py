"""Hugging Face weights both ways, one adapter per family (`Family.hf_module`; which HF `model_type`
imports as which family is the registry's `Family.hf_model_types`), maxlite/families/NAME/hf.py:
llama2 ↔ Llama (Mistral with a sliding window), qwen2/qwen3 ↔ Qwen2/Qwen3, gemma3 ↔ Gemma3ForCausalLM,
gpt3 ↔ GPT-2, mixtral/qwen3_moe ↔ Mixtral/Qwen3-MoE, and the newer families beside them.

    python -m maxlite.bridge.hf export CKPT OUT_DIR [--step N] [--dtype float32|bfloat16|float16|mxfp4]
                                        [--max-shard-size 50GB] [--tokenizer auto|none|PATH]
    python -m maxlite.bridge.hf import HF_DIR CKPT [RECIPE.yml] [key=value ...]

Numpy only: torch is not needed to convert. Both directions stream, one HF tensor at a time: an
import reads a tensor from the safetensors files, converts it to weight_dtype and writes it into
its layer's slice of the checkpoint (checkpoints/streamed.py) before reading the next; an export
reads one layer's slice from the checkpoint, converts and writes it. Host memory holds a few
tensors, not the model. The layout conventions are in hf_llama.py and families/gpt3/hf.py.
An import records the compute dtype config.json states (float32 stays float32; float16 computes in
float32), unless the recipe or key=value sets `dtype`, and the dtype the tensors were stored in,
which an export writes again unless --dtype says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
from typing import Sequence

import ml_dtypes
import numpy as np

from maxlite import cli, config as C
from maxlite.schema import MODEL_KEYS
import importlib

from maxlite.bridge import fp8, hf_convert
from maxlite.bridge import params as P
from maxlite.models.families import FAMILIES, family
from maxlite.bridge.safetensors_io import SafetensorsDir, parse_size, write_sharded


def adapter(module: str):
    """A family's HF adapter module (`Family.hf_module`)."""
    return importlib.import_module(module)


def model_types() -> dict[str, str]:
    """HF config.json `model_type` → the adapter module that imports it, from the family registry."""
    return {t: f.hf_module for f in FAMILIES.values() for t in f.hf_model_types}
# save_pretrained's default max_shard_size in the transformers this was built against (5.25: "50GB";
# 4.x had "5GB"): an export's shards are as big as transformers' own.
MAX_SHARD_SIZE = "50GB"
# config.json's dtype → the compute dtype an import records (float16 is not a maxlite compute dtype:
# float32 computes its values exactly)
COMPUTE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}
EXPORT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16), "mxfp4": np.dtype(np.float32)}  # mxfp4: the adapter's MXFP4 tensors from float32, bfloat16 the rest


def _progress(total: int, every: int = 50):
    count = [0]

    def report(name: str) -> None:
        count[0] += 1
        if count[0] % every == 0 or count[0] == total:
            print(f"  {count[0]}/{total} tensors ({name})", file=sys.stderr, flush=True)
    return report


def _tokenizer(cfg, spec: str):
    """(tokenizer or None): `auto` is the model's own tokenizer — the recipe's `tokenizer_path` (an
    imported model's is its HF directory's), or the bundled one it trained on from text data; a
    model trained on synthetic data with no tokenizer named has none."""
    if spec == "none" or (spec == "auto" and cfg.dataset_type == "synthetic" and not cfg.tokenizer_path):
        return None
    from maxlite.data.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer_path if spec == "auto" else C.resolve_path(spec), cfg.bos_id, cfg.eos_id)
    check_vocab(tok, cfg.vocab_size, "--tokenizer none")
    return tok


def check_vocab(tok, vocab_size: int, escape: str) -> None:
    """A tokenizer fits a model when the model embeds every id it makes (the data pipeline's rule);
    models pad their tables past the tokenizer (Qwen2.5: 151,665 ids, 151,936 rows)."""
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tok.path} has {tok.vocab_size} ids but the model's vocab_size is "
                         f"{vocab_size}: not this model's tokenizer; give the right one or {escape}")


# Files beside an HF tokenizer.json that carry its special tokens and chat template.
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def export_hf(cfg, params, out_dir: str, dtype: str = "float32", max_shard_size: str | int = MAX_SHARD_SIZE,
              tokenizer: str = "auto", verbose: bool = False) -> list[str]:
    """maxlite params (nnx.State or nested dict) → an HF directory (the family's architecture); returns
    the shard names."""
    arch = adapter(family(cfg).hf_module)
    if cfg.chunk_attn_window_size and "chunked" not in family(cfg).layer_pattern:
        raise ValueError(f"chunk_attn_window_size={cfg.chunk_attn_window_size}: chunked-attention layers are Llama "
                         f"4's (decoder_block=llama4); {cfg.decoder_block}'s architecture has none")
    maps = arch.tensor_maps(cfg)  # refuses what the architecture cannot hold, before writing
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype {dtype}: choose float32, bfloat16, float16 or mxfp4")
    if dtype == "mxfp4" and not hasattr(arch, "MXFP4_TENSORS"):
        raise ValueError(f"--dtype mxfp4: {cfg.decoder_block} has no MXFP4 form (gpt_oss's experts have); choose "
                         f"float32 or bfloat16")
    from maxlite.models import lora
    pure = lora.merged(cfg, P.to_pure(params))  # a LoRA run's adapters folded into the weights
    tok = _tokenizer(cfg, tokenizer)
    bos = cfg.bos_id if cfg.bos_id >= 0 else (tok.bos_id if tok else None)
    eos = cfg.eos_id if cfg.eos_id >= 0 else (tok.eos_id if tok else None)
    out = pathlib.Path(C.resolve_path(out_dir))
    stale = sorted(p.name for p in out.glob("*.safetensors*")) if out.is_dir() else []
    if stale:  # transformers would pick up a stale model.safetensors or index over the new files
        raise ValueError(f"{out_dir} already holds {stale[0]}: export into a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    entries = hf_convert.export_entries(cfg, maps, pure, EXPORT_DTYPES[dtype])
    if dtype == "mxfp4":  # the family's own quantized form (gpt-oss: its experts' blocks and scales)
        from maxlite.bridge import mxfp4
        entries = mxfp4.quantized_entries(entries, arch.MXFP4_TENSORS, EXPORT_DTYPES["bfloat16"])
    names = write_sharded(out, entries, parse_size(max_shard_size), {"maxlite_model": cfg.model_name},
                          _progress(len(entries)) if verbose else None)
    config = arch.hf_config(cfg, "bfloat16" if dtype == "mxfp4" else dtype, bos, eos)
    if dtype == "mxfp4":
        config["quantization_config"] = arch.MXFP4_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if hasattr(arch, "write_processor"):  # a vision model's image processor, as it was imported
        arch.write_processor(cfg, out)
    generation = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tok is not None and tok.path.endswith(".json") and not tok.path.endswith("vocab.json"):
        shutil.copyfile(tok.path, out / "tokenizer.json")
        source = pathlib.Path(tok.path).parent
        if (source / "tokenizer_config.json").is_file():  # an imported model's own: chat template and all
            for name in TOKENIZER_FILES:
                if (source / name).is_file():
                    shutil.copyfile(source / name, out / name)
        else:
            (out / "tokenizer_config.json").write_text(json.dumps({
                "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_target_length,
                **{k: tok._backend.id_to_token(i) for k, i in (("bos_token", bos), ("eos_token", eos))
                   if i is not None}}, indent=2) + "\n")
        if cfg.dataset_type in C.CHAT_DATASETS:  # the chat template the model was fine-tuned with, for apply_chat_template
            from maxlite.data.chat import template_source
            config_file = out / "tokenizer_config.json"
            config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                               "chat_template": template_source(cfg)[1]}, indent=2) + "\n")
    return names


def read_hf_config(hf_dir: str) -> dict:
    path = pathlib.Path(hf_dir) / "config.json"
    if not path.is_file():
        raise C.ConfigError(f"{hf_dir}: no config.json (is this a Hugging Face model directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise C.ConfigError(f"{path}: not valid JSON ({e})") from None


def _own_tokenizer(hf_dir: str) -> str | None:
    """The HF directory's tokenizer, if it ships one."""
    for name in ("tokenizer.json", "tokenizer.model"):
        if (pathlib.Path(hf_dir) / name).is_file():
            return hf_dir
    return None


def stored_dtype(hf_cfg: dict) -> str | None:
    """The dtype config.json says the weights are in (5.x `dtype`, 4.x `torch_dtype`; a multimodal
    model's text config may state its own)."""
    for where in (hf_cfg.get("text_config") or {}, hf_cfg):
        for key in ("dtype", "torch_dtype"):
            if isinstance(where.get(key), str):
                return where[key]
    return None


@dataclasses.dataclass
class Import:
    """What an import reads, resolved before any tensor is: the model's Config, its tensor table,
    the tensors, which of them to leave out, and the dtype config.json says they are stored in."""
    cfg: object
    maps: list
    source: object
    ignore: object
    stored_dtype: str | None


def prepare_import(hf_dir: str, argv: Sequence[str] = ()) -> Import:
    """HF directory (any of MODEL_TYPES) → what to convert, every name and shape checked (one line
    for a missing tensor, one the model has no place for, or a wrong shape).

    `argv` is a maxlite recipe and/or key=value (training keys); the model keys come from config.json,
    and so does the compute dtype unless `argv` sets it.
    """
    hf_dir = C.resolve_path(hf_dir)
    hf_cfg = read_hf_config(hf_dir)
    module = model_types().get(hf_cfg.get("model_type"))
    if module is None:
        raise C.ConfigError(f"{hf_dir}: config.json model_type={hf_cfg.get('model_type')!r} has no maxlite "
                            f"equivalent (supported: {', '.join(model_types())})")
    arch = adapter(module)
    try:
        overrides = arch.config_overrides(hf_cfg)
    except KeyError as e:
        raise C.ConfigError(f"{hf_dir}/config.json: required key {e.args[0]!r} is missing") from None
    except ValueError as e:  # the family's refusals of what maxlite does not model: the user's model
        raise C.ConfigError(str(e)) from None
    source = fp8.dequantized(SafetensorsDir(hf_dir))
    if hasattr(arch, "tensor_overrides"):  # what the tensors say beside config.json (DeepSeek's MTP layers)
        overrides.update(arch.tensor_overrides(hf_cfg, set(source.names())))
    if hasattr(arch, "processor_overrides"):  # a vision model's image processor (preprocessor_config.json)
        overrides.update(arch.processor_overrides(hf_dir))
    own = _own_tokenizer(hf_dir)
    user = C.user_keys(argv)
    if own and "tokenizer_path" not in user:  # the model's own tokenizer, unless told otherwise
        overrides["tokenizer_path"] = own
    if "dtype" not in user and stored_dtype(hf_cfg) in COMPUTE_DTYPES:  # compute as it was stored
        overrides["dtype"] = COMPUTE_DTYPES[stored_dtype(hf_cfg)]
    cfg = C.load(list(argv), **overrides)
    if cfg.tokenizer_path:
        from maxlite.data.tokenizer import load_tokenizer
        try:
            check_vocab(load_tokenizer(cfg.tokenizer_path, cfg.bos_id, cfg.eos_id), cfg.vocab_size,
                        "pass tokenizer_path= for this model")
        except ValueError as e:  # the tokenizer the user gave does not fit the model
            raise C.ConfigError(str(e)) from None
    if hasattr(arch, "tensor_source"):  # a family's stored form read as the maps name it (gpt-oss: MXFP4)
        source = arch.tensor_source(source)
    # the prefix its writer used, where an adapter reads several (else its own table)
    maps = arch.import_maps(cfg, set(source.names())) if hasattr(arch, "import_maps") else arch.tensor_maps(cfg)
    # tensors an adapter leaves out knowingly (GLM's multi-token-prediction layer), said by the adapter
    skipped = arch.skipped(cfg, set(source.names())) if hasattr(arch, "skipped") else set()
    ignore = lambda name: name in skipped or arch.ignore(name)  # noqa: E731
    hf_convert.check_tensors(cfg, maps, source, ignore)
    left = arch.left_behind(set(source.names())) if hasattr(arch, "left_behind") else None
    if left:  # a part of the checkpoint maxlite has no module for (Gemma 4's audio tower): said, once
        print(f"maxlite: {hf_dir}: {left}", file=sys.stderr, flush=True)
    stored = stored_dtype(hf_cfg)
    return Import(cfg, maps, source, ignore, stored if stored in EXPORT_DTYPES else None)


def import_hf(hf_dir: str, argv: Sequence[str] = (), verbose: bool = False):
    """HF directory → (maxlite Config, nested numpy params in weight_dtype), in memory (for Python
    users and tests; the CLI streams into a checkpoint: import_to_checkpoint)."""
    im = prepare_import(hf_dir, argv)
    pure = hf_convert.import_params(im.cfg, im.maps, im.source, np.dtype(im.cfg.weight_dtype), im.ignore,
                                    _progress(len(im.source.names())) if verbose else None)
    return im.cfg, pure


def import_to_checkpoint(hf_dir: str, checkpoint: str, argv: Sequence[str] = (), verbose: bool = False):
    """HF directory → a params-only maxlite checkpoint (local or gs://) and its recipe.yml, streamed:
    one HF tensor is read, converted to weight_dtype and written at a time, so host memory holds a
    few tensors, never the model. In a multi-process JAX run each process converts every n-th
    tensor (collective: every process calls it). Returns (cfg, the recipe's path)."""
    import jax

    from maxlite.checkpoints.streamed import Streamed, save_streamed

    im = prepare_import(hf_dir, argv)
    cfg = im.cfg
    base = dataclasses.replace(cfg, lora_rank=0)  # the imported weights; LoRA keys go to the recipe
    dtype = np.dtype(cfg.weight_dtype)
    leaves = [Streamed(path, shape, dtype, (1,) * lead + shape[lead:])
              for path, (shape, lead) in hf_convert.leaf_shapes(cfg, im.maps).items()]
    share = (jax.process_index(), jax.process_count())
    total = len(range(share[0], len(list(hf_convert.expand(cfg, im.maps))), share[1]))  # this process's
    if share[1] > 1 and verbose:
        print(f"process {share[0]} of {share[1]}: converts {total} tensors (every {share[1]}-th)",
              file=sys.stderr, flush=True)
    pieces = lambda: hf_convert.pieces(cfg, im.maps, im.source, dtype, share,  # noqa: E731
                                       _progress(total) if verbose else None)
    extra = {"hf_import": {"source": C.resolve_path(hf_dir), "dtype": im.stored_dtype}}
    save_streamed(checkpoint, base, leaves, pieces, extra)
    recipe = write_recipe(cfg, checkpoint, argv) if jax.process_index() == 0 else f"{checkpoint}/recipe.yml"
    return cfg, recipe


def write_recipe(cfg, checkpoint: str, argv: Sequence[str] = ()) -> str:
    """CKPT/recipe.yml, a ready `maxlite.train` recipe: load_parameters_path, the imported model's keys
    (every one of the schema's: the recipe never leans on base.yml's defaults for the model), the
    dtypes, sequence length and tokenizer it was imported with, the balance-loss weight its
    config.json states, and every key the user passed to the import (recipe file and key=value)."""
    import yaml

    keys = MODEL_KEYS + ("dtype", "weight_dtype", "max_target_length", "tokenizer_path", "load_balance_loss_weight")
    keys += tuple(sorted(C.user_keys(argv) - set(keys) - {"load_parameters_path"}))
    recipe = {"load_parameters_path": checkpoint,
              **{k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(cfg, k)) for k in keys)}}
    path = f"{checkpoint.rstrip('/')}/recipe.yml"
    text = "# written by `python -m maxlite.bridge.hf import`: the model of this checkpoint\n"
    if "://" in checkpoint:  # gs:// and friends: through the same client stack as the checkpoint
        import fsspec
        with fsspec.open(path, "w") as f:
            f.write(text + yaml.safe_dump(recipe, sort_keys=False))
    else:
        pathlib.Path(path).write_text(text + yaml.safe_dump(recipe, sort_keys=False))
    return path


def source_dtype(meta: dict, cfg) -> str:
    """The dtype an export writes unless told: the one the model came in with (its import's record,
    or that of the imported checkpoint it was trained from: `load_parameters_path`), else the
    dtype its weights are kept in."""
    from maxlite import checkpoints

    stated = (meta.get("hf_import") or {}).get("dtype")
    parent = (meta.get("config") or {}).get("load_parameters_path")
    if not stated and parent:
        try:
            stated = (checkpoints.read_meta(*checkpoints.resolve_step_dir(parent)).get("hf_import") or {}).get("dtype")
        except C.ConfigError:  # moved or gone: the weights' own dtype
            stated = None
    return stated if stated in EXPORT_DTYPES else cfg.weight_dtype


def export_checkpoint(checkpoint: str, out_dir: str, step: int | None = None, dtype: str | None = None,
                      max_shard_size: str | int = MAX_SHARD_SIZE, tokenizer: str = "auto",
                      verbose: bool = False) -> tuple[str, list[str]]:
    """A checkpoint → an HF directory, streamed: each HF tensor is read from the checkpoint (its layer's
    slice), converted, written and freed before the next; what was read is checked against the
    checkpoint's checksums (a corrupt checkpoint leaves no export). A LoRA run's adapters are merged
    in memory. Returns (the dtype written, the shard names)."""
    from maxlite import checkpoints
    from maxlite.checkpoints.streamed import ParamsReader, lazy_params

    reader = ParamsReader(checkpoint, step)
    cfg = reader.config()
    dtype = dtype or source_dtype(reader.meta, cfg)
    if cfg.lora_rank:
        params = checkpoints.load_params(checkpoint, step=reader.step)[1]
    else:
        params = lazy_params(reader, cfg)
    try:
        names = export_hf(cfg, params, out_dir, dtype, max_shard_size, tokenizer, verbose)
        reader.check()
    except checkpoints.CheckpointCorrupt:
        out = pathlib.Path(C.resolve_path(out_dir))
        for p in [*out.glob("*.safetensors*"), out / "config.json"]:
            p.unlink(missing_ok=True)
        raise
    return dtype, names


# a file the user named that is not there is theirs; any other error of the import (the converter)
# is a bug and keeps its traceback; export's checks are ValueErrors (main turns them into one line)
@cli.entry_point(FileNotFoundError)
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxlite.bridge.hf", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="maxlite checkpoint → Hugging Face directory (the family's architecture)")
    ex.add_argument("checkpoint")
    ex.add_argument("out_dir")
    ex.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ex.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default=None,
                    help="default: the dtype the model was imported in, else its weights' (weight_dtype)")
    ex.add_argument("--max-shard-size", default=MAX_SHARD_SIZE, help=f"largest safetensors file (default {MAX_SHARD_SIZE}: save_pretrained's in transformers 5.25)")
    ex.add_argument("--tokenizer", default="auto", help="auto | none | a tokenizer path to ship along")
    pe = sub.add_parser("export-peft", help="a LoRA run's checkpoint → PEFT adapter directory (unmerged)")
    pe.add_argument("checkpoint")
    pe.add_argument("out_dir")
    pe.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    pe.add_argument("--base-model", default="", help="base_model_name_or_path for adapter_config.json")
    im = sub.add_parser("import", help=f"Hugging Face directory ({', '.join(model_types())}) → maxlite checkpoint")
    im.add_argument("hf_dir")
    im.add_argument("checkpoint")
    im.add_argument("recipe", nargs="*", help="[RECIPE.yml] [key=value ...] training keys to store")
    args = parser.parse_args(argv)
    if args.command == "import":
        args.checkpoint = C.resolve_path(args.checkpoint)
    try:
        if args.command == "export":
            dtype, names = export_checkpoint(args.checkpoint, args.out_dir, args.step, args.dtype,
                                             args.max_shard_size, args.tokenizer, verbose=True)
            print(f"wrote {args.out_dir} ({len(names)} safetensors file(s), {dtype})")
        elif args.command == "export-peft":
            from maxlite.bridge.peft import export_peft
            from maxlite.checkpoints import load_params
            cfg, params = load_params(args.checkpoint, step=args.step)
            out = export_peft(cfg, params, args.out_dir, args.base_model)
            print(f"wrote {out} (PEFT LoRA adapter: r={cfg.lora_rank}, {', '.join(cfg.lora_targets)})")
    except ValueError as e:  # what an export cannot write: one line, as before
        raise C.ConfigError(str(e)) from None
    if args.command == "import":
        from maxlite.mesh import initialize_distributed

        initialize_distributed()  # several hosts (as a training run finds them): each converts a share
        _, recipe = import_to_checkpoint(args.hf_dir, args.checkpoint, args.recipe, verbose=True)
        print(f"wrote {args.checkpoint}; train from it with: python -m maxlite.train {recipe} [key=value ...]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
