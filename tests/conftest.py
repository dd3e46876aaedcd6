"""Tests run on CPU with 8 simulated devices; set before JAX is imported anywhere.

`MAXLITE_TEST_PLATFORMS=cuda` runs the accelerator-only tests on a GPU machine (benchmarks/gpu.sh)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.xla_flags import CHEAP_TRACE_ENV, cpu_xla_flags  # noqa: E402  (imports no JAX)

os.environ["JAX_PLATFORMS"] = os.environ.get("MAXLITE_TEST_PLATFORMS", "cpu")
# On CPU, also tests/xla_flags.py's cheaper compile and locations; a GPU run keeps XLA's own code
# generation.
os.environ["XLA_FLAGS"] = (cpu_xla_flags(8) if os.environ["JAX_PLATFORMS"] == "cpu"
                           else "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if os.environ["JAX_PLATFORMS"] == "cpu":
    os.environ.update(CHEAP_TRACE_ENV)
# JAX's persistent compilation cache for the tests' own processes, where the trainer's subprocesses
# keep theirs (base.yml jax_cache_dir): many tests build the same small programs in new closures,
# which the in-memory cache cannot match; a compiled program's disk copy can (about 8% of the CPU
# time of test_moe.py + test_attention.py, from an empty cache).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.expanduser("~/.cache/maxlite/jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# The tests' processes trace and compile as a training process does, and outside `build` too (a
# module's forward, a sampler): the same cycle collector thresholds (maxlite/gc_policy.py) from the
# start. test_step + test_alignment + test_lora (40 tests, `-n 0`, empty compile cache) took 233 user
# CPU-seconds with them, 265 under Python's defaults. A test that measures memory a user's process
# would hold runs under Python's defaults (tests/test_bridge_hf_stream.py).
from maxlite.gc_policy import collect_less_often  # noqa: E402  (imports no JAX)

collect_less_often()

import pytest  # noqa: E402


@pytest.fixture
def run_dir(tmp_path):
    """A fresh base_output_directory for one test."""
    path = tmp_path / "runs"
    path.mkdir()
    return str(path)


@pytest.fixture(autouse=True)
def bf16_cpu_products():
    """Every test starts on the default CPU product (bf16): a build in an earlier test of this worker
    sets the process's path by measurement (cpu_matmul=auto), which under load may pick f32 and
    would leak into a later test that traces projections without a build of its own."""
    from maxlite.models import matmul

    with matmul.cpu_path("bf16"):
        yield


@pytest.fixture(scope="session")
def ray_head():
    """One private Ray head (tests/ray_cluster.py) for every test that trains on a cluster and leaves
    it standing (jobs, worker crashes, keeper actors): a head start and stop is 10-30 s on 2 busy
    cores. Tests that stop nodes or start clusters themselves (drains, lost hosts, the launcher's
    own local cluster) keep their own. The multi-process files share one xdist worker (below), so
    the session builds it once; it stops after the last test that uses it (pytest_runtest_teardown),
    not at the session's end: idle, its 20 processes took 3 CPU-seconds a minute from the tests
    this worker runs after it."""
    from tests.ray_cluster import RayHead

    with RayHead(num_cpus=4) as head:
        _shared_ray_head.append(head)
        yield head
        _shared_ray_head.clear()


_shared_ray_head: list = []  # the session's head while it runs, for pytest_runtest_teardown


def pytest_runtest_teardown(item, nextitem):
    """Stop the shared Ray head once no later test on this worker uses it (the users run back to back:
    pytest_collection_modifyitems). RayHead.close is idempotent; the fixture's own exit finds it done."""
    uses = lambda it: it is not None and "ray_head" in it.fixturenames  # noqa: E731
    if _shared_ray_head and uses(item) and not uses(nextitem):
        _shared_ray_head[0].close()


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
MULTI_PROCESS_FILES = {"test_ray.py", "test_resilience_procs.py", "test_checkpoints_procs.py", "test_context_procs.py",
                       "test_compile_cache_procs.py", "test_rollout_actors.py", "test_bridge_hf_procs.py"}


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            # Hand files out in the collection's order (pytest_collection_modifyitems: longest first),
            # not xdist's default for scopes, most tests first: that put the multi-process group (39
            # tests, the longest share) behind five files with more tests, and test_family_table
            # and test_train (15 and 8 tests, 2-5 minutes each) near the end, where one worker ran
            # them alone while the other had nothing left.
            self.config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "multi_process" if os.path.basename(path) in MULTI_PROCESS_FILES else path

    return ByFile(config, log)


# Files whose tests take longest (seconds, their tests summed, on the 2-core machine at the last
# clean run; test_family_table's includes its setup, 390 s at the clean run of 3824740 (23 cases on XLA's
# default code generation), test_hf_parity's its 50 s one; the multi-process group, 800+ s, goes
# first anyway). The scheduler hands out the longest work first, so the run ends on short files with
# both workers busy; the other files follow by number of tests, xdist's own guess. A rough figure is
# enough: it only orders the files.
LONG_FILES_S = {"test_family_table.py": 420, "test_hf_parity.py": 60, "test_presets.py": 174, "test_alignment.py": 158,
                "test_plan.py": 140, "test_train.py": 127, "test_generate.py": 119}


# pytest-timeout (pyproject's `timeout`, 600 s) for one test; these start clusters or several training
# processes one after another (a Ray run with a restart, a Slurm requeue): 177 s for the longest on an
# idle machine, so 900 s stays far from a slow run and still ends a hang.
LONG_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    """Longest first (the scheduler hands out files in this order): the multi-process group, then the
    LONG_FILES_S, then the rest by number of tests. Inside the group the shared Ray head's users run
    back to back, so it stops early (ray_head): the first file that uses it ends with its users, the
    next starts with them. A file's tests stay together (its module fixtures are built once)."""
    count: dict[str, int] = {}
    for item in items:
        count[item.path.name] = count.get(item.path.name, 0) + 1
    head_files = sorted({item.path.name for item in items if "ray_head" in item.fixturenames})

    def key(item):
        name = item.path.name
        if name in head_files:
            i, uses = head_files.index(name), "ray_head" in item.fixturenames
            return (0, 0, i, uses if i == 0 else not uses)
        if name in MULTI_PROCESS_FILES:
            return (0, 1, name)
        return (1, -LONG_FILES_S.get(name, 0), -count[name], name)

    items.sort(key=key)  # stable: a file's own order otherwise
    for item in items:
        long = item.path.name in MULTI_PROCESS_FILES or any(item.get_closest_marker(m) for m in ("ray", "slurm"))
        if long and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))
