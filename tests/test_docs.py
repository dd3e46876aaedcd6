"""The docs say what the code does: README.md and docs/*.md walked as a new user reads them.

- every `key=value` shown (in a command, or alone in inline code) and every key of a recipe YAML
  block is a config key (configs/base.yml; presets may only set its keys);
- every `python -m maxlite...` / `ray_entry...` command line parses: the module's own argparse
  parser accepts its flags (stopped right after parsing, nothing runs), and recipe arguments are
  `[recipe.yml] key=value` with known keys;
- every results JSON a page names exists and records the `command` that produced it, and every
  measured figure (a number with a unit in a paragraph that says it was measured or states a speed,
  or in a table of such numbers) sits in a paragraph or table that names one, or says it is
  historical;
- the docs' own command sequences (docs/data.md top to bottom, then docs/lora.md) never land two
  recipes that cannot share a run in one run directory (maxlite/run_identity.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib
import re
import shlex

import pytest
import yaml

from maxlite import config as C
from maxlite import run_identity
from maxlite.rundir import RunDir

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KEYS = {f.name for f in dataclasses.fields(C.Config)}
RESULTS = ROOT / "benchmarks" / "results"
# modules whose arguments are all a recipe: `[recipe.yml] key=value ...`
RECIPE_MODULES = ("maxlite.train", "ray_entry.train")


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of fenced blocks and of 4-space indented blocks after a blank line."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            lang, body, i = line.strip()[3:].strip(), [], i + 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            blocks.append((lang, "\n".join(body)))
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()) and not line.lstrip().startswith(("-", "|")):
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            blocks.append(("", "\n".join(body)))
            continue
        i += 1
    return blocks


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _commands(text: str) -> list[list[str]]:
    """Every `python -m MODULE args...` that starts a line of a code block (after environment
    assignments, `$ `, or `--` as in `ray job submit ... -- python -m ...`), as [MODULE, args...]."""
    lines = []
    for lang, body in _code_blocks(text):
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        joined = body.replace("\\\n", " ").splitlines()
        # a command shown with the error it answers is a deliberate mistake
        lines += [line for line, after in zip(joined, [*joined[1:], ""]) if "error:" not in after]
    found = []
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        for i, w in enumerate(words[:-2]):
            before = words[:i]
            starts = all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*|\$", b) for b in before) or before[-1:] == ["--"]
            if starts and re.fullmatch(r"(\S*/)?python(3(\.\d+)?)?", w) and words[i + 1] == "-m":
                module, args = words[i + 2], []
                for a in words[i + 3:]:
                    if a in ("&&", "||", "|", ";", "&", ">", "2>&1") or a.startswith(">"):
                        break
                    if a != "..." or args[-1:] and args[-1].startswith("--"):  # `--prompt "..."` keeps its value
                        args.append(a)
                synopsis = any(a.startswith("[") or a.endswith("]") and "=" not in a for a in args)
                if module.startswith(("maxlite", "ray_entry")) and not synopsis:  # not a usage synopsis
                    found.append([module, *args])
    return found


def _check_recipe(args: list[str]) -> None:
    # RECIPE, key=value: a page's placeholders for any recipe and any key
    args = [a for a in args if not a.startswith(("-", "key=")) and not re.fullmatch(r"[A-Z][A-Z_]*", a)]
    path, cli = C.parse_cli(args)
    assert path is None or path.endswith((".yml", ".yaml")), f"{path} is not a recipe"
    unknown = sorted(set(cli) - KEYS)
    assert not unknown, f"unknown config key(s) {unknown}"


class _Parsed(BaseException):
    """Raised right after a module's parser accepted its arguments: nothing runs."""

    def __init__(self, namespace):
        self.namespace = namespace


@pytest.fixture
def parse_only(monkeypatch):
    for name in ("parse_args", "parse_intermixed_args"):
        original = getattr(argparse.ArgumentParser, name)

        def stop(self, args=None, namespace=None, _original=original):
            raise _Parsed(_original(self, args, namespace))

        monkeypatch.setattr(argparse.ArgumentParser, name, stop)


def _parses(module: str, args: list[str], where: str) -> str | None:
    """None when the command parses, else what is wrong."""
    try:
        if module in RECIPE_MODULES:
            _check_recipe(args)
            return None
        try:
            code = _main_of(module)(args)
        except _Parsed as parsed:
            recipe = getattr(parsed.namespace, "recipe", None) or getattr(parsed.namespace, "recipe_args", None)
            if recipe:
                _check_recipe(list(recipe))
            return None
        except SystemExit as e:
            return f"{where}: does not parse (exit {e.code})"
        return f"{where}: returned {code} without parsing its arguments"
    except (AssertionError, C.ConfigError) as e:
        return f"{where}: {e}"


def _main_of(module: str):
    for name in (module, f"{module}.__main__"):
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        if hasattr(mod, "main"):
            return mod.main
    raise AssertionError(f"no module {module} with a main()")


def test_every_command_line_in_the_docs_parses(parse_only, capsys):
    seen, bad = 0, []
    for page in PAGES:
        for command in _commands(page.read_text()):
            bad.append(_parses(command[0], command[1:], f"{page.name}: python -m {shlex.join(command)}"))
            seen += 1
    capsys.readouterr()
    assert seen > 50  # the walk found the commands
    assert not any(bad), "\n".join(b for b in bad if b)


# keyword arguments of other APIs the pages quote (not maxlite keys), and the placeholder `key=value`
FOREIGN = {"key": "any key", "gated_linear_unit": "Megatron/NeMo", "activation_func": "Megatron/NeMo",
           "resume": "wandb.init", "preferred_element_type": "jax.lax.dot", "step": "maxlite.api / load_params",
           "enable_thinking": "Qwen3's chat template"}


def test_every_key_shown_is_a_config_key():
    bad = []
    for page in PAGES:
        text = page.read_text()
        for command in _commands(text):
            if command[0] in RECIPE_MODULES or command[0] in ("maxlite.plan", "maxlite.launch", "maxlite.bridge.nemo"):
                bad += [f"{page.name}: {k}= in `{' '.join(command)[:80]}`"
                        for k in C.parse_cli([a for a in command[1:] if "=" in a and not a.startswith("-")])[1]
                        if k not in KEYS and k != "key"]
        for span in re.findall(r"`([a-z][a-z0-9_]*)=[^`\s]*`", _prose(text)):
            if span not in KEYS and span not in FOREIGN:
                bad.append(f"{page.name}: `{span}=`")
        for lang, body in _code_blocks(text):
            if lang in ("yaml", "yml"):
                data = yaml.safe_load(body) or {}
                if "apiVersion" in data:  # a Kubernetes manifest, not a recipe
                    continue
                bad += [f"{page.name}: YAML key {k}" for k in data if k not in KEYS and k != "base_config"]
    assert not bad, "\n".join(bad)


def test_every_preset_sets_only_config_keys():
    for preset in sorted((C.CONFIG_DIR / "models").glob("*.yml")):
        assert set(yaml.safe_load(preset.read_text()) or {}) - {"base_config"} <= KEYS, preset.name  # another preset


UNIT = r"(?:ms|s|min|h|GB|GiB|MB|MiB|TB|TiB|KiB|tokens/s|tok/s|%|TFLOP/s|GB/s|MB/s|MiB/s|GiB/s)"
# a number with a unit, or a ratio (`2.6×`; `4 × 8` is a product, not a figure)
FIGURE = re.compile(r"(?<![\w.=@:/-])\d[\d,]*(?:\.\d+)?(?:\s?" + UNIT + r"(?![\w/])|×(?!\s))")
MEASURED = re.compile(r"\b(measured|measures|median|benchmark(ed)?|ran at|we ran|took)\b", re.I)
RATE = re.compile(r"\d\s?(tokens/s|tok/s|TFLOP/s|GB/s|MB/s|MiB/s|GiB/s)")  # a speed is a result wherever it stands
# figures others publish (MaxText's, a library's own) are quoted with their source, not re-run here
QUOTED = re.compile(r"\bpublish(es|ed)?\b", re.I)
CITED = re.compile(r"(?:benchmarks/results/)?([\w.+-]+\.json)")


def _cites(para: str) -> bool:
    return any((RESULTS / name).is_file() for name in CITED.findall(para))


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs and tables (a table with the paragraph right before it)."""
    out, previous = [], ""
    for block in re.split(r"\n\s*\n", _prose(text)):
        if block.lstrip().startswith("|"):
            out.append(previous + "\n" + block)
        else:
            out.append(block)
        previous = block
    return out


def test_every_results_json_named_exists_and_holds_its_command():
    bad = []
    for page in PAGES:
        for name in sorted(set(re.findall(r"benchmarks/results/[\w.+-]+\.json", page.read_text()))):
            path = ROOT / name
            if not path.is_file():
                bad.append(f"{page.name}: {name} does not exist")
            elif "command" not in json.loads(path.read_text()):
                bad.append(f"{page.name}: {name} holds no `command`")
    assert not bad, "\n".join(bad)


def test_every_measured_figure_names_its_json():
    bad = []
    for page in PAGES:
        for para in _paragraphs(page.read_text()):
            table = any(line.lstrip().startswith("|") for line in para.splitlines())
            figures = FIGURE.findall(re.sub(r"`[^`]*`", "", para))
            measured = MEASURED.search(para) or RATE.search(re.sub(r"`[^`]*`", "", para))
            if not figures or not (measured or (table and len(figures) >= 4)) or QUOTED.search(para):
                continue
            if not _cites(para) and "historical" not in para.lower():
                bad.append(f"{page.name}: {para.strip()[:160]!r}")
    assert not bad, "measured figures without the JSON that holds their command:\n" + "\n".join(bad)


def _train_commands(page: str) -> list[list[str]]:
    return [c[1:] for c in _commands((ROOT / "docs" / page).read_text()) if c[0] == "maxlite.train"]


def test_the_docs_sequences_never_share_a_run_between_recipes(tmp_path, monkeypatch):
    """docs/data.md top to bottom, then docs/lora.md, each command's run directory opened as the loop
    opens it (its config.yml written): no later command lands in a run of another recipe."""
    monkeypatch.chdir(tmp_path)
    for name in ("data", "out", "more"):
        (tmp_path / name).mkdir()
    (tmp_path / "val.jsonl").write_text('{"text": "x"}\n')
    commands = _train_commands("data.md") + _train_commands("lora.md")
    assert len(commands) >= 4
    dirs = {}
    for args in commands:
        if not args[0].endswith(".yml") or not (C.CONFIG_DIR / args[0]).is_file():
            continue  # a recipe the page makes first (an imported checkpoint's)
        # the blend's gs:// half is the page's example bucket: the local half stands for it
        args = [("data_prefix=out/corpus_text_document" if a.startswith("data_prefix=") and "gs://" in a else a)
                for a in args]
        cfg = C.load([*args, f"base_output_directory={tmp_path}/runs"])
        held = run_identity.verdict(cfg.run_dir, cfg.run_name, C.to_plain_dict(cfg))
        assert not held.refused and not held.replaced, f"{shlex.join(args)}: {held}"
        RunDir(cfg, primary=True)  # writes its config.yml, as the run does
        step = pathlib.Path(cfg.run_dir) / "checkpoints" / "1"  # and a complete step: it binds the directory
        step.mkdir(parents=True, exist_ok=True)
        (step / "_CHECKPOINT_METADATA").write_text("{}")
        dirs.setdefault(cfg.run_dir, []).append(shlex.join(args))
    assert len(dirs) >= 4, dirs  # text, text on other files, indexed, LoRA: a run each


def test_the_readme_names_every_module_and_every_page():
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1]
    package = ROOT / "maxlite"
    parts = [f"maxlite/{p.name}" + ("/" if p.is_dir() else "") for p in sorted(package.iterdir())
             if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and not p.name.startswith("__"))]
    assert [p for p in parts if p not in layout] == []
    assert all(layout.count(f"\n{p} ") <= 1 for p in parts), "a module named twice"
    table = readme.split("## Documentation", 1)[1].split("\n## ", 1)[0]
    assert [p.name for p in PAGES[1:] if f"docs/{p.name}" not in table] == []
