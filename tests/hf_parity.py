"""Run by tests/test_hf_parity.py in a subprocess with XLA's default CPU code generation (what users run;
the tests' own processes compile cheaper, tests/xla_flags.py): each random Hugging Face model of
tests/hf_models.py saved, imported by maxlite's bridge, and maxlite's float32 logits compared with
transformers' on a few tokens. argv[1]: a JSON object family → hf_models name; argv[2]: how many times
to compile the scanned Kimi Linear (`scanned_kimi`; 0: not at all). Prints one JSON object: the
XLA_FLAGS this process started with, per family the imported decoder_block and the relative error
‖ours − theirs‖ / ‖theirs‖ (or the error the import or the forward raised), and the scanned Kimi
Linear's relative error at each compilation."""

import json
import os
import sys
import tempfile
import traceback

import jax
import numpy as np
import torch
import transformers
from flax import nnx

from maxlite.bridge import hf
from tests import hf_models
from tests.helpers import jax_logits

B, T = 2, 16  # past the sliding windows (hf_models.WINDOW), well inside every model's positions


def compare(name: str, directory: str) -> dict:
    """(decoder_block, relative error) of maxlite's import of the random model `name`."""
    model = hf_models.model(name)
    model.save_pretrained(directory)
    cfg, pure = hf.import_hf(directory, ["dtype=float32", f"max_target_length={T}"])
    ids = np.random.default_rng(1).integers(0, model.config.get_text_config().vocab_size, (B, T))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.float().numpy()
    ours = jax_logits(cfg, pure, ids)
    return {"decoder_block": cfg.decoder_block,
            "relative": float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))}


def scanned_kimi(directory: str, compiles: int) -> dict:
    """A random Kimi Linear whose four layers after the dense one are two units of (Kimi delta attention,
    latent attention), stored stacked, imported, its forward lowered once and compiled `compiles` times
    (the persistent compilation cache off: each a real compilation): the stacks and each compilation's
    relative error. XLA:CPU built programs that differ from one compilation to the next for such a stack
    run by a loop while the delta rule's zero state was a constant (maxlite/models/gated_deltanet.py
    zero_state)."""
    from maxlite.models.layout import layer_stacks
    from maxlite.state import abstract_params

    config = hf_models.config("kimi_linear")
    config.layer_types = ["linear_attention"] + ["linear_attention", "full_attention"] * 2
    config.mlp_layer_types = ["dense"] + ["sparse"] * 4
    config.num_hidden_layers = 5
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory)
    cfg, pure = hf.import_hf(directory, ["dtype=float32", f"max_target_length={T}"])
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (B, T))
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.float().numpy()
    graphdef, state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, pure)
    inputs = (ids, np.broadcast_to(np.arange(T), (B, T)), np.ones((B, T), np.int32))
    lowered = jax.jit(lambda st, *a: nnx.merge(graphdef, st)(*a)).lower(state, *inputs)
    jax.config.update("jax_enable_compilation_cache", False)
    relative = []
    for _ in range(compiles):
        ours = np.asarray(lowered.compile()(state, *inputs))
        relative.append(float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)))
    return {"stacks": [[s.name, s.count, len(s.unit)] for s in layer_stacks(cfg)], "relative": relative}


def main(families: dict) -> dict:
    torch.set_num_threads(1)  # tiny models: torch's threads only contend on the shared cores
    out = {}
    for family, name in families.items():
        with tempfile.TemporaryDirectory() as directory:
            try:
                out[family] = compare(name, directory)
            except Exception:  # one family's failure is its own test's, the others still report
                out[family] = {"error": traceback.format_exc(limit=-4)}
    return out


if __name__ == "__main__":
    got = main(json.loads(sys.argv[1]))
    with tempfile.TemporaryDirectory() as directory:
        try:  # its failure is its own test's: the families' results still report
            scanned = scanned_kimi(directory, int(sys.argv[2])) if int(sys.argv[2]) else None
        except Exception:
            scanned = {"error": traceback.format_exc(limit=-4)}
    print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "families": got, "scanned_kimi": scanned}))
