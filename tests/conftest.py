"""Tests run on CPU with 8 simulated devices; set before JAX is imported anywhere.

`MAXLITE_TEST_PLATFORMS=cuda` runs the accelerator-only tests on a GPU machine (benchmarks/gpu.sh)."""

import os
import sys

os.environ["JAX_PLATFORMS"] = os.environ.get("MAXLITE_TEST_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# JAX's persistent compilation cache for the tests' own processes, where the trainer's subprocesses
# keep theirs (base.yml jax_cache_dir): many tests build the same small programs in new closures,
# which the in-memory cache cannot match; a compiled program's disk copy can (about 8% of the CPU
# time of test_moe.py + test_attention.py, from an empty cache).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/maxlite/jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture
def run_dir(tmp_path):
    """A fresh base_output_directory for one test."""
    path = tmp_path / "runs"
    path.mkdir()
    return str(path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny torch models: one thread. On a shared 2-core machine torch's default threads contend
    (8 tiny steps took 67 s with 2 threads, 3 s with 1). Opt in per module with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`; torch is imported only then."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Two pytest-xdist workers (addopts). A file's tests stay on one worker, so its module fixtures are
# built once. The files whose tests start several training processes at once (multi-process JAX
# over gloo, Ray clusters) share one worker and never run beside each other: two such runs on the
# two cores starved a gloo collective past the 60 s hang watchdog. (xdist's own `loadgroup` cannot
# do this with pytest 9.2: the group suffix it writes to `item._nodeid` is no longer read.)
MULTI_PROCESS_FILES = {"test_ray.py", "test_resilience_procs.py", "test_checkpoints_procs.py", "test_context_procs.py"}


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "multi_process" if os.path.basename(path) in MULTI_PROCESS_FILES else path

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    """The multi-process files first: the longest share of the run starts at once (stable sort)."""
    items.sort(key=lambda item: item.path.name not in MULTI_PROCESS_FILES)
