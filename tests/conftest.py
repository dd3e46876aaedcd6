"""Tests run on CPU with 8 simulated devices; set before JAX is imported anywhere."""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

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
