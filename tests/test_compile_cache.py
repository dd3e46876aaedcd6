"""The persistent compilation cache: a second process compiling the same program loads it."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp
from maxlite import config as C
from maxlite.compile_cache import enable_compilation_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
path = enable_compilation_cache(C.load(["base.yml", "jax_cache_dir=" + sys.argv[1]]))
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()
print(json.dumps({"path": path, "hits": sum("cache_hits" in e for e in events)}))
"""


def _run(cache_dir):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, cache_dir], env=env, check=True,
                         capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_second_run_loads_compiled_programs_from_the_cache(tmp_path):
    cache = tmp_path / "jax"
    first = _run(str(cache))
    assert first == {"path": str(cache), "hits": 0}
    assert any(cache.iterdir())  # the program was written
    assert _run(str(cache))["hits"] >= 1


def test_empty_cache_dir_leaves_the_cache_off():
    import jax

    from maxlite import config as C
    from maxlite.compile_cache import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache(C.load(["base.yml", "jax_cache_dir="])) == ""
    assert jax.config.jax_compilation_cache_dir == before
