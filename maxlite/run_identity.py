"""Which recipes may share a run directory: THE decision behind the default run name, and behind
refusing a command that lands in another recipe's run.

A run directory holds one run, and running the same command again resumes it (a larger `steps=`
extends it). Recipes that cannot continue each other's state must not share one: another data
source (a saved data position means nothing in other data), another objective, another LoRA
setting or another choice of what trains (the optimizer holds state for those parameters only), or
another model shape (the checkpoint does not fit). So:
- the default name (`run_name` unset) is `<recipe>_<model>`, plus a part for each of data source,
  objective, LoRA and what trains that the command line changes from the recipe (`base_tiny_text`,
  `base_tiny_sft_lora16`, `base_tiny_text-3fa9c1` for other files, `base_deepseek-v3.2_dense_warmup`):
  the same command always gives the same name;
- a run whose directory already holds a run of a recipe that differs in one of these keys (a
  model key changed on the command line, an explicit `run_name`, a path that resolves elsewhere)
  is refused in one line naming the keys and a `run_name=` to use, before anything is written;
- but only a checkpoint binds a directory to its recipe: a run that never saved one (its data
  was wrong, its checkpoint to start from was another model's, it never reached a save) left
  nothing to resume, and a run of another recipe replaces it there, saying so in one line.
This module imports no JAX (config.py calls it while loading).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import re
from typing import Any

import yaml

from maxlite.schema import MODEL_KEYS

DATA = ("dataset_type", "dataset_path", "bundled_prompts", "data_prefix", "tokenizer_path")
OBJECTIVE = ("train_objective",)
LORA = ("lora_rank", "lora_targets")
# what trains besides LoRA's choice: a vision tower's part, DeepSeek sparse attention's dense warm-up
TRAINS = ("vision_train", "index_stage")
# the model's keys (schema.py): a checkpoint of one model neither fits nor continues another
KEYS = DATA + OBJECTIVE + LORA + TRAINS + MODEL_KEYS


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _digest(values: dict[str, Any], keys: tuple[str, ...]) -> str:
    text = json.dumps([_plain(values[k]) for k in keys], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:6]


def default_run_name(recipe_path: str | None, model_name: str, recipe: dict[str, Any], values: dict[str, Any]) -> str:
    """The run directory's name when `run_name` is unset. `recipe`: the keys as the YAML and the
    model preset give them; `values`: with the command line applied."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", pathlib.Path(recipe_path).stem) if recipe_path else "run"
    parts = [stem if model_name in ("default", stem) else f"{stem}_{model_name}"]
    changed = {k for k in DATA + OBJECTIVE + LORA + TRAINS if _plain(values[k]) != _plain(recipe[k])}
    if changed & set(DATA):
        files = DATA[1:]
        parts.append(str(values["dataset_type"]) + (f"-{_digest(values, files)}" if changed & set(files) else ""))
    if "train_objective" in changed:
        parts.append(str(values["train_objective"]))
    if changed & set(LORA):
        parts.append(f"lora{values['lora_rank']}" + (f"-{_digest(values, ('lora_targets',))}"
                                                     if "lora_targets" in changed else ""))
    if "vision_train" in changed:
        parts.append(f"vision-{values['vision_train']}")
    if "index_stage" in changed:
        parts.append(str(values["index_stage"]))
    return "_".join(parts)


def differences(saved: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """The keys of KEYS (those both recipes record) whose values differ."""
    return [k for k in KEYS if k in saved and k in values and _plain(saved[k]) != _plain(values[k])]


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a run directory holds for a run of a recipe: `refused`, the line refusing it there (a
    run of another recipe with a checkpoint); `replaced`, the line saying it replaces a run of
    another recipe that never saved one; both empty: its own run, or none."""
    refused: str = ""
    replaced: str = ""


def verdict(run_dir: str, run_name: str, mine: dict[str, Any]) -> Verdict:
    """May a run of the recipe `mine` (config.to_plain_dict) go on in `run_dir`? The run there is
    known by its config.yml (written at every start); it differs when a key of KEYS does, and it
    binds the directory only when it saved a checkpoint."""
    import fsspec  # here, not at the top: loading a config (config.py imports this module) stays light

    try:
        with fsspec.open(f"{run_dir}/config.yml", "r") as f:
            saved = yaml.safe_load(f.read()) or {}
    except FileNotFoundError:
        return Verdict()
    keys = differences(saved, mine)
    if not keys:
        return Verdict()
    shown = ", ".join(f"{k}={_short(saved[k])} there, {_short(mine[k])} here" for k in keys)
    if not _saved_a_checkpoint(run_dir, saved):
        return Verdict(replaced=f"maxlite: {run_dir} held a run of another recipe ({shown}) that never saved a "
                                f"checkpoint: nothing to resume there, this run replaces it")
    return Verdict(refused=f"{run_dir} holds a run of another recipe ({shown}): this one cannot resume it; pass "
                           f"run_name={run_name}-{_digest(mine, KEYS)} for a run of this recipe (or the earlier "
                           f"values to resume that one)")


def _saved_a_checkpoint(run_dir: str, saved: dict[str, Any]) -> bool:
    """Whether the run of config.yml `saved` left a complete checkpoint (one found corrupt included:
    it is still that run's) where it saved them."""
    from maxlite.checkpoints.storage import checkpoint_root, complete_steps  # JAX-free; imports config (→ us)

    return bool(complete_steps(checkpoint_root(saved.get("checkpoint_dir") or "", run_dir)))


def _short(value: Any) -> str:
    text = json.dumps(_plain(value), default=str) if not isinstance(value, str) else (value or '""')
    return text if len(text) <= 60 else text[:57] + "..."
