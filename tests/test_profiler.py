"""Profiles (maxlite/profiler.py, the ProfilerHook): a `profiler: xplane` run's trace read back by the
profile plugin's own code (xprof: its run discovery and its trace-viewer conversion), locally and on
gs:// (the emulator); the run report links it; a step out of device memory leaves a memory profile."""

import gzip
import json
import os

import pytest

from helpers import SMALL
from maxlite import config as C, profiler
from maxlite.train import train
from tests.gcs_emulator import gcs_emulator, make_bucket  # noqa: F401

xprof = pytest.importorskip("xprof")

PROFILED = [*SMALL, "steps=6", "profiler=xplane", "enable_checkpointing=false", "straggler_report_interval=0"]
TRAIN_STEP = "CommonPjRtLoadedExecutable::Execute (jit_train_step)"  # the compiled step run, once per step


def _step_calls(xplane_files) -> int:
    """Calls of the train step in the trace, as xprof's trace viewer converts it."""
    from xprof.convert import raw_to_tool_data

    data, content_type = raw_to_tool_data.xspace_to_tool_data(xplane_files, "trace_viewer", {})
    assert content_type == "application/json"
    return sum(1 for e in json.loads(data)["traceEvents"] if e.get("name") == TRAIN_STEP)


def _profile_plugin(logdir: str):
    """TensorBoard's profile plugin (xprof) pointed at `logdir`, as `tensorboard --logdir` builds it."""
    import argparse

    from tensorboard.plugins import base_plugin
    from xprof.profile_plugin import ProfilePlugin

    flags = argparse.Namespace(master_tpu_unsecure_channel="")
    return ProfilePlugin(base_plugin.TBContext(logdir=logdir, flags=flags, data_provider=None))


def test_a_6_step_run_writes_a_trace_of_its_steps_that_the_profile_plugin_reads(tmp_path, capsys):
    cfg = C.load([*PROFILED, "run_name=prof", f"base_output_directory={tmp_path}", "write_report=true"])
    train(cfg)
    run_dir = cfg.run_dir
    traces = profiler.files(run_dir)["traces"]
    assert len(traces) == 1 and traces[0].endswith(".xplane.pb")
    assert "maxlite: profile of steps 2-6 → " in capsys.readouterr().out  # skip 1 (it compiles), then 5

    plugin = _profile_plugin(run_dir)  # what `tensorboard --logdir {run_dir}` shows
    (run,) = plugin.runs_imp()
    session = os.path.basename(os.path.dirname(traces[0]))
    assert run == f"profile/{session}"
    assert "trace_viewer@" in plugin.run_tools_imp(run)
    assert _step_calls(traces) == 5  # steps 2-6, no more

    page = open(f"{run_dir}/report.html").read()  # the run report links the trace
    assert f'href="profile/plugins/profile/{session}/' in page and "tensorboard --logdir" in page


@pytest.mark.gcs
def test_a_gs_run_directory_gets_the_same_trace(tmp_path, gcs_emulator):  # noqa: F811
    import gcsfs

    bucket = make_bucket(gcs_emulator.url, "profiles")
    cfg = C.load([*PROFILED, "run_name=prof", f"base_output_directory={bucket}/runs", "steps=3",
                  "profiler_steps=2"])
    train(cfg)
    traces = profiler.files(cfg.run_dir)["traces"]
    assert len(traces) == 1 and traces[0].startswith(f"{bucket}/runs/prof/profile/plugins/profile/")
    local = tmp_path / os.path.basename(traces[0])
    gcsfs.GCSFileSystem().get(traces[0], str(local))
    assert _step_calls([str(local)]) == 2


def test_a_step_out_of_device_memory_leaves_a_memory_profile(tmp_path, capsys):
    """131072 tokens of plain attention: the step's [B, K, G, T, S] scores alone are 128 GiB, an
    allocation XLA's CPU client refuses ("RESOURCE_EXHAUSTED: Out of memory allocating ...")."""
    cfg = C.load([*SMALL, "run_name=oom", f"base_output_directory={tmp_path}", "max_target_length=131072",
                  "attention=dot_product", "enable_checkpointing=false", "steps=2"])
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        train(cfg)
    (path,) = profiler.files(cfg.run_dir)["memory"]
    assert os.path.basename(path) == "memory_oom_p0.prof"
    raw = gzip.decompress(open(path, "rb").read())  # pprof: a gzipped profile.proto
    assert b"space" in raw and b"bytes" in raw  # its sample types
    assert f"maxlite: out of device memory; device memory in use → {path}" in capsys.readouterr().err
    status = json.load(open(f"{cfg.run_dir}/status.json"))
    assert status["state"] == "failed" and "RESOURCE_EXHAUSTED" in status["error"]
