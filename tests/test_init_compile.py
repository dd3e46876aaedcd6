"""The initialiser's compile level on XLA:CPU (maxlite.state.init_compiler_options). That the bytes are
XLA's defaults' is tests/test_family_table.py's check (its subprocess runs without a level in
XLA_FLAGS, so it initialises through this option against bytes -O3 wrote); the compile's cost is
benchmarks/results/init_compile.json."""

from maxlite.state import init_compiler_options


def test_without_a_level_in_xla_flags_the_initialiser_compiles_below_xlas_default(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    level = init_compiler_options()["xla_backend_optimization_level"]
    assert 0 < level < 3  # -O0 computes other last bits (tests/xla_flags.py); -O3 is XLA's default


def test_a_level_set_in_xla_flags_is_kept(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=3")
    assert init_compiler_options() is None
