"""`hf import` on several processes (jax.distributed over gloo on CPU, the environment a training run
uses: MAXLITE_COORDINATOR / Slurm / a TPU pod): each converts every n-th tensor into the one
checkpoint, which holds what a one-process import writes."""

from __future__ import annotations

import re

import numpy as np

from maxlite import checkpoints, config as C
from maxlite.bridge import hf, params as P
from tests.helpers import run_module, shown


def _converted(out: str) -> tuple[int, int]:
    """(tensors converted, tensors this process was given), from its progress lines."""
    done, total = re.findall(r"^\s+(\d+)/(\d+) tensors", out, re.M)[-1]
    return int(done), int(total)


def test_two_processes_each_convert_their_share_into_the_checkpoint_one_process_writes(tmp_path):
    cfg = C.load(["base.yml", "model_name=tiny", "base_num_decoder_layers=3"])
    pure = P.random_params(cfg)
    hf.export_hf(cfg, pure, str(tmp_path / "hf"))
    one, two = str(tmp_path / "one"), str(tmp_path / "two")

    codes, outs = run_module("maxlite.bridge.hf", ["import", str(tmp_path / "hf"), one], processes=1)
    assert codes == [0], outs[0][-2000:]
    codes, outs2 = run_module("maxlite.bridge.hf", ["import", str(tmp_path / "hf"), two], processes=2)
    assert codes == [0, 0], shown(outs2)

    whole, _ = _converted(outs[0])
    shares = [_converted(out) for out in outs2]
    assert [done for done, _ in shares] == [(whole + 1) // 2, whole // 2]  # every other tensor each
    assert all(done == total for done, total in shares)
    assert "process 1 of 2" in outs2[1]

    cfg1, params1 = checkpoints.load_params(one)  # each verified against its checksums
    cfg2, params2 = checkpoints.load_params(two)
    got = dict(P.leaves(P.to_pure(params2)))
    for path, value in P.leaves(P.to_pure(params1)):
        assert np.array_equal(got[path], value), path
    for path, value in P.leaves(pure):  # and both hold the exported weights
        assert np.array_equal(got[path], np.asarray(value, dtype=got[path].dtype)), path
    recipe = C.load([f"{two}/recipe.yml"])
    assert recipe.load_parameters_path == two and recipe.base_num_decoder_layers == 3


def test_a_process_that_cannot_import_leaves_at_once_and_takes_its_peer_with_it(tmp_path):
    """The HF directory is missing on process 0's host: it says so in one line and exits 2 at once;
    process 1, waiting for it in the save's barrier, ends too (the coordination service it held is
    gone) instead of both waiting out jax.distributed's and Orbax's barriers (300 s each)."""
    cfg = C.load(["base.yml", "model_name=tiny", "base_num_decoder_layers=1"])
    hf.export_hf(cfg, P.random_params(cfg), str(tmp_path / "hf"))
    not_on_host_0 = ("sh", "-c", 'if [ "$MAXLITE_PROCESS_ID" = 0 ]; then set -- "$1" "$2" "$3" "$4" "$5-not-here" "$6"; '
                     'fi; exec "$@"', "sh")
    codes, outs = run_module("maxlite.bridge.hf", ["import", str(tmp_path / "hf"), str(tmp_path / "ck")], processes=2,
                             timeout=150, prefix=not_on_host_0)
    assert codes[0] == 2 and codes[1] != 0, shown(outs)
    assert outs[0].count("maxlite: error:") == 1 and "hf-not-here" in outs[0] and "Traceback" not in outs[0], shown(outs)
    assert not (tmp_path / "ck" / "0").exists()
