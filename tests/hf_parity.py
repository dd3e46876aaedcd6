"""Run by tests/test_hf_parity.py in a subprocess with XLA's default CPU code generation (what users run;
the tests' own processes compile cheaper, tests/xla_flags.py): each random Hugging Face model of
tests/hf_models.py saved, imported by maxlite's bridge, and maxlite's float32 logits compared with
transformers' on a few tokens. argv[1]: a JSON object family → hf_models name. Prints one JSON
object: the XLA_FLAGS this process started with, and per family the imported decoder_block and the
relative error ‖ours − theirs‖ / ‖theirs‖ (or the error the import or the forward raised)."""

import json
import os
import sys
import tempfile
import traceback

import numpy as np
import torch

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
    print(json.dumps({"xla_flags": os.environ.get("XLA_FLAGS", ""), "families": got}))
