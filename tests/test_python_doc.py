"""docs/python.md as written: its ```python blocks run, in order, as one script (CPU, 4 simulated
devices, an empty working directory), and print what the page says they print."""

import os
import re
import subprocess
import sys

from tests.xla_flags import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "python.md")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_python_doc_examples_run_as_written(tmp_path):
    text = open(DOC).read()
    blocks = python_blocks(text)
    assert len(blocks) >= 7  # config, build, step, off-mesh forward, checkpoint, generate, export
    script = tmp_path / "python_doc.py"
    script.write_text("\n\n".join(blocks))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(4),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    # what the page's comments say the examples print
    for claim in re.findall(r"print\(.*\)\s+# (.+)$", text, flags=re.M):
        assert claim.strip() in r.stdout, (claim, r.stdout[-3000:])
    assert re.search(r"\{'data': 1, 'stage': 1, 'fsdp': 4, .*'tensor': 1\} 0", r.stdout)  # all 4 devices on the fsdp axis
    assert os.path.exists(tmp_path / "hf_demo" / "config.json")
