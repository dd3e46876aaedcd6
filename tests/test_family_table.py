"""Every family's numbers, held across refactors of the decoder layer: one shrunk preset per family
(helpers.shrunk, float32), scanned and unrolled, its parameter tree (paths, shapes, dtypes: what a
saved checkpoint must match to restore), the bytes of its initial parameters, and the losses of its
first two training steps on a fixed synthetic batch.

The table (tests/data/family_table.json) was written before the decoder layer became mixer +
feed-forward kinds. Update it ONLY when a change is meant to alter a family's parameters or numerics,
by running `MAXLITE_WRITE_TABLE=1 pytest tests/test_family_table.py`, and say why in the commit.

Tree and parameter bytes must be identical on every CPU (the initialisation is counter-based random
numbers). The losses are compared to 1e-6 relative: float32 sums reorder between CPUs' kernels (an
AVX2-only CPU and one with AVX-512 differ in the last bits), and a few hundred products of O(1)
terms in float32 (epsilon 1.2e-7) stay well inside that; a changed layer moves them by far more.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from maxlite import config as C
from tests.helpers import ROOT, shrunk

TABLE = pathlib.Path(__file__).parent / "data" / "family_table.json"
# one preset per family: the smallest of each, shrunk with its traits (MoE layouts included)
PRESETS = {"llama2": "tiny", "gpt3": "gpt3-126m", "qwen2": "qwen2.5-0.5b", "qwen3": "qwen3-0.6b",
           "gemma3": "gemma3-1b", "mixtral": "tiny-moe", "qwen3_moe": "qwen3-30b-a3b"}
CASES = [(fam, scan) for fam in PRESETS for scan in (True, False)]


def _key(fam: str, scan: bool) -> str:
    return f"{fam}/{'scan' if scan else 'unrolled'}"


@pytest.fixture(scope="module")
def computed() -> dict:
    """Every case's numbers, from one process with XLA's default code generation
    (tests/family_numbers.py): the table holds XLA's output bytes, which the tests' cheaper compile
    would compute in other last bits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAXLITE_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8", PYTHONPATH=ROOT)
    cases = {_key(fam, scan): PRESETS[fam] for fam, scan in CASES}
    done = subprocess.run([sys.executable, "-m", "tests.family_numbers", json.dumps(cases)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.environ.get("MAXLITE_WRITE_TABLE") != "1", reason="writes the table")
def test_write_table(computed):
    TABLE.write_text(json.dumps(computed, indent=1) + "\n")


@pytest.mark.parametrize("fam, scan", CASES, ids=[f"{f}-{'scan' if s else 'unrolled'}" for f, s in CASES])
def test_family_numbers_unchanged(fam, scan, computed):
    assert C.load(shrunk(PRESETS[fam])).decoder_block == fam
    expected = json.loads(TABLE.read_text())[_key(fam, scan)]
    got = computed[_key(fam, scan)]
    assert (got["tree"], got["leaves"]) == (expected["tree"], expected["leaves"]), "parameter tree changed"
    assert got["params"] == expected["params"], "initial parameters changed"
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-6)
