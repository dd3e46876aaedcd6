"""The bridge to the PyTorch world.

- `hf.py`: Hugging Face safetensors export/import, one adapter per family (maxlite/families/NAME/hf.py,
  over the shared tables of hf_llama.py and hf_moe.py; `python -m maxlite.bridge.hf`); numpy only.
- `torch_model.py`: a PyTorch twin of the maxlite decoders that loads maxlite params directly.
- `nemo.py`: a maxlite recipe as Megatron-LM arguments and NeMo 2.0 overrides.

torch, transformers and safetensors are the optional extra `maxlite[torch]`; only this package
imports them, and only where needed.
"""

from __future__ import annotations

import importlib

INSTALL_HINT = "pip install 'maxlite[torch]'"


def require(module: str):
    """Import an optional dependency or fail with one line saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"maxlite.bridge needs {module}: {INSTALL_HINT}") from None
