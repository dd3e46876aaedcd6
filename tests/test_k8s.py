"""k8s/*.yaml: rendered as `envsubst` would, then validated offline.

Core objects and every pod template go through kubernetes-validate's strict schemas; RayCluster
and RayJob through the KubeRay CRD subset in tests/data/kuberay/. On top: the TPU v6e 4x4 and GPU
facts, no root, no public Service, no key files, and the training commands (in the RayJob and in
docs/gke.md) parse as maxlite configs that match the slice they run on.
"""

from __future__ import annotations

import copy
import importlib.metadata
import pathlib
import re
import shlex
import shutil
import subprocess
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from maxlite import config as C
from maxlite.launch import ray_trainer

ROOT = pathlib.Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
DOCS = ROOT / "docs" / "gke.md"
CRD = yaml.safe_load((ROOT / "tests" / "data" / "kuberay" / "ray.io_v1.schema.yaml").read_text())
K8S_VERSION = "1.35"  # a current GKE minor; kubernetes-validate ships its schemas offline

SAMPLE = {
    "PROJECT_ID": "my-project",
    "NAMESPACE": "default",
    "KSA_NAME": "maxlite-ksa",
    "GSA_NAME": "maxlite-gsa",
    "GS_BUCKET": "my-maxlite-bucket",
    "DOCKER_IMAGE": "us-east5-docker.pkg.dev/my-project/maxlite/maxlite-tpu:latest",
    "RUN_NAME": "rayjob-8b-4096-4x4",
}
MANIFESTS = sorted(K8S.glob("*.yaml"))
TPU_CLUSTERS = ["maxlite-tpu-cluster.yaml", "maxlite-tpu-cluster-gcsfuse.yaml"]
VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")  # what envsubst replaces


def render(path: pathlib.Path, values: dict[str, str] = SAMPLE) -> str:
    text = path.read_text()
    unknown = {a or b for a, b in VAR.findall(text)} - values.keys()
    assert not unknown, f"{path.name}: undocumented variables {sorted(unknown)} (envsubst makes them '')"
    return VAR.sub(lambda m: values[m.group(1) or m.group(2)], text)


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(K8S / name)) if d]


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    """(where, PodTemplateSpec) of every pod a RayCluster/RayJob makes."""
    if doc["kind"] not in ("RayCluster", "RayJob"):
        return []
    spec = cluster_spec(doc)
    found = [("head", spec["headGroupSpec"]["template"])]
    found += [(f"worker {g['groupName']}", g["template"]) for g in spec.get("workerGroupSpecs", [])]
    if doc["kind"] == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        found.append(("submitter", doc["spec"]["submitterPodTemplate"]))
    return found


def crd_errors(doc: dict) -> list[str]:
    schema = {"$defs": CRD["$defs"], "$ref": f"#/$defs/{doc['kind']}"}
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def pod_template_error(template: dict) -> str | None:
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
    try:
        kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
    return None


def security_problems(doc: dict) -> list[str]:
    """Root containers, privilege escalation, host namespaces, public services, key files."""
    problems = []
    for where, tmpl in pod_templates(doc):
        pod = tmpl["spec"]
        psc = pod.get("securityContext", {})
        if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
            problems.append(f"{where}: shares a host namespace")
        if pod.get("serviceAccountName") != SAMPLE["KSA_NAME"]:
            problems.append(f"{where}: not running as the Workload Identity service account")
        for vol in pod.get("volumes", []):
            if "secret" in vol or "hostPath" in vol:
                problems.append(f"{where}: volume {vol['name']} is a secret/hostPath")
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            sc = {**psc, **c.get("securityContext", {})}  # the container's own settings win
            if sc.get("runAsNonRoot") is not True or sc.get("runAsUser", 0) == 0:
                problems.append(f"{where}/{c['name']}: may run as root")
            if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}/{c['name']}: allowPrivilegeEscalation is not false")
            if sc.get("privileged"):
                problems.append(f"{where}/{c['name']}: privileged")
            if any(e["name"] == "GOOGLE_APPLICATION_CREDENTIALS" for e in c.get("env", [])):
                problems.append(f"{where}/{c['name']}: uses a key file")
    if doc["kind"] in ("RayCluster", "RayJob"):
        head = cluster_spec(doc)["headGroupSpec"]
        if head.get("serviceType") != "ClusterIP" or head.get("enableIngress"):
            problems.append("head service is exposed outside the cluster")
        if head.get("headService", {}).get("spec", {}).get("type", "ClusterIP") != "ClusterIP":
            problems.append("headService is exposed outside the cluster")
    if doc["kind"] == "Service" and doc.get("spec", {}).get("type", "ClusterIP") in ("LoadBalancer", "NodePort"):
        problems.append(f"Service {doc['metadata']['name']} is {doc['spec']['type']}")
    return problems


def containers(tmpl: dict) -> list[dict]:
    return tmpl["spec"]["containers"]


# ---- rendering ---------------------------------------------------------------------------

def test_manifests_exist():
    names = {p.name for p in MANIFESTS}
    assert {"serviceaccount.yaml", "maxlite-gpu-cluster.yaml", "maxlite-tpu-rayjob.yaml", *TPU_CLUSTERS} <= names


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_renders_to_namespaced_objects(path):
    text = render(path)
    assert "$" not in text, f"{path.name}: a '$' survives rendering"
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert docs
    for doc in docs:
        assert doc["metadata"]["namespace"] == SAMPLE["NAMESPACE"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "maxlite"


@pytest.mark.skipif(shutil.which("envsubst") is None, reason="gettext envsubst not installed")
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_render_equals_real_envsubst(path):
    out = subprocess.run([shutil.which("envsubst")], input=path.read_text(), env=SAMPLE, capture_output=True,
                         text=True, check=True).stdout
    assert out == render(path)


def test_docs_name_existing_files():
    named = set(re.findall(r"(?:k8s|docker)/[\w.-]+", DOCS.read_text()))
    assert {"k8s/maxlite-tpu-cluster.yaml", "k8s/serviceaccount.yaml"} <= named
    assert [n for n in sorted(named) if not (ROOT / n).exists()] == []


def test_docs_export_every_manifest_variable():
    docs = DOCS.read_text()
    used = {a or b for p in MANIFESTS for a, b in VAR.findall(p.read_text())}
    missing = [v for v in sorted(used) if not re.search(rf"export {v}=", docs)]
    assert not missing, f"docs/gke.md never exports {missing}"


# ---- schemas -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_objects_match_their_schemas(path):
    for doc in load(path.name):
        if doc["apiVersion"] == "ray.io/v1":
            assert crd_errors(doc) == [], f"{path.name}: {crd_errors(doc)}"
            for where, tmpl in pod_templates(doc):
                assert pod_template_error(tmpl) is None, f"{path.name} {where}: {pod_template_error(tmpl)}"
                volumes = {v["name"] for v in tmpl["spec"].get("volumes", [])}
                for c in containers(tmpl):  # a mount of a missing volume fails only at pod creation
                    assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, f"{path.name} {where}"
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


TYPOS = {
    "numOfHost": lambda s: _rename(s["workerGroupSpecs"][0], "numOfHosts", "numOfHost"),
    "workerGroupSpec": lambda s: _rename(s, "workerGroupSpecs", "workerGroupSpec"),
    "headGroupSpecs": lambda s: _rename(s, "headGroupSpec", "headGroupSpecs"),
    "rayStartParams int": lambda s: s["workerGroupSpecs"][0]["rayStartParams"].update({"num-cpus": 0}),
    "replicas as string": lambda s: s["workerGroupSpecs"][0].update(replicas="1"),
    "numOfHosts 0": lambda s: s["workerGroupSpecs"][0].update(numOfHosts=0),
    "serviceType typo": lambda s: s["headGroupSpec"].update(serviceType="ClusterIp"),
}


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
@pytest.mark.parametrize("typo", list(TYPOS))
def test_kuberay_typo_fails_the_schema(kind, typo):
    name = "maxlite-tpu-cluster.yaml" if kind == "RayCluster" else "maxlite-tpu-rayjob.yaml"
    doc = copy.deepcopy(load(name)[0])
    TYPOS[typo](cluster_spec(doc))
    assert crd_errors(doc), f"schema accepted a {kind} with {typo}"


def test_rayjob_field_typos_fail_the_schema():
    doc = load("maxlite-tpu-rayjob.yaml")[0]
    for mutate in (lambda s: _rename(s, "shutdownAfterJobFinishes", "shutdownAfterJobFinished"),
                   lambda s: s.update(submissionMode="K8SJobMode"),
                   lambda s: _rename(s, "entrypoint", "entryPoint")):
        bad = copy.deepcopy(doc)
        mutate(bad["spec"])
        assert crd_errors(bad)


def test_pod_template_typo_fails_core_schema():
    tmpl = copy.deepcopy(load("maxlite-tpu-cluster.yaml")[0]["spec"]["headGroupSpec"]["template"])
    tmpl["spec"]["containers"][0]["securityContxt"] = tmpl["spec"]["containers"][0].pop("securityContext")
    assert pod_template_error(tmpl) is not None


# ---- what the manifests must say ---------------------------------------------------------

@pytest.mark.parametrize("name", TPU_CLUSTERS + ["maxlite-tpu-rayjob.yaml"])
def test_tpu_v6e_4x4_slice(name):
    spec = cluster_spec(load(name)[0])
    (group,) = spec["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (1, 1, 1)
    assert group["numOfHosts"] == 4
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4"}
    (worker,) = containers(group["template"])
    assert worker["resources"]["requests"]["google.com/tpu"] == "4"
    assert worker["resources"]["limits"]["google.com/tpu"] == "4"
    head = spec["headGroupSpec"]["template"]
    assert "nodeSelector" not in head["spec"]  # the head runs on the CPU node pool
    assert all("google.com/tpu" not in str(c["resources"]) for c in containers(head))


def test_gpu_cluster():
    spec = load("maxlite-gpu-cluster.yaml")[0]["spec"]
    (group,) = spec["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] >= 1
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    (worker,) = pod["containers"]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_no_root_no_public_service_no_keys(path):
    for doc in load(path.name):
        assert security_problems(doc) == []
    content = yaml.safe_dump_all(load(path.name))  # the objects, not the comments
    assert not re.search(r"private_key|key\.json|GOOGLE_APPLICATION_CREDENTIALS|kind: Secret", content)


def _head(doc: dict) -> dict:
    return doc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _drop_non_root(doc: dict) -> None:
    worker = doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    worker["securityContext"].pop("runAsNonRoot")
    worker["containers"][0]["securityContext"].pop("runAsNonRoot")


SECURITY_BREAKS = {
    "runAsUser 0": (lambda d: _head(d)["securityContext"].update(runAsUser=0), "root"),
    "no runAsNonRoot": (_drop_non_root, "root"),
    "LoadBalancer": (lambda d: d["spec"]["headGroupSpec"].update(serviceType="LoadBalancer"), "exposed"),
    "escalation": (lambda d: _head(d)["securityContext"].pop("allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    "key file": (lambda d: _head(d)["env"].append({"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": "/k.json"}), "key file"),
}


@pytest.mark.parametrize("case", list(SECURITY_BREAKS))
def test_security_check_catches(case):
    mutate, expect = SECURITY_BREAKS[case]
    doc = copy.deepcopy(load("maxlite-tpu-cluster.yaml")[0])
    mutate(doc)
    assert any(expect in p for p in security_problems(doc)), security_problems(doc)


def test_serviceaccount_uses_workload_identity():
    (sa,) = load("serviceaccount.yaml")
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["name"] == SAMPLE["KSA_NAME"]
    assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"] == (
        f"{SAMPLE['GSA_NAME']}@{SAMPLE['PROJECT_ID']}.iam.gserviceaccount.com")
    assert "secrets" not in sa


def _strip_gcsfuse(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    for _, tmpl in pod_templates(doc):
        annotations = tmpl["metadata"].pop("annotations")
        assert annotations == {"gke-gcsfuse/volumes": "true"}
        vols = tmpl["spec"]["volumes"]
        (fuse,) = [v for v in vols if "csi" in v]
        assert fuse["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
        assert fuse["csi"]["volumeAttributes"]["bucketName"] == SAMPLE["GS_BUCKET"]
        vols.remove(fuse)
        for c in containers(tmpl):
            c["volumeMounts"].remove({"name": fuse["name"], "mountPath": "/data"})
    return doc


def test_gcsfuse_variant_is_the_tpu_cluster_plus_the_bucket_mount():
    assert _strip_gcsfuse(load("maxlite-tpu-cluster-gcsfuse.yaml")[0]) == load("maxlite-tpu-cluster.yaml")[0]


def test_rayjob_runs_the_tpu_cluster_and_cleans_up():
    job = load("maxlite-tpu-rayjob.yaml")[0]["spec"]
    assert job["rayClusterSpec"] == load("maxlite-tpu-cluster.yaml")[0]["spec"]
    assert job["shutdownAfterJobFinishes"] is True and job["submissionMode"] == "K8sJobMode"
    assert job["submitterPodTemplate"]["spec"]["restartPolicy"] == "Never"


def test_ray_version_is_the_pinned_ray():
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (ray,) = [Requirement(p) for p in pins if Requirement(p).name == "ray"]
    for name in ("maxlite-tpu-cluster.yaml", "maxlite-gpu-cluster.yaml"):
        version = load(name)[0]["spec"]["rayVersion"]
        assert version in ray.specifier, f"{name}: rayVersion {version} outside pyproject's {ray}"
    assert importlib.metadata.version("ray") in ray.specifier


# ---- the training commands ---------------------------------------------------------------

def check_command(argv: list[str], workers: int, devices_per_worker: int) -> C.Config:
    """A `python -m ray_entry.train ...` argv is a valid maxlite config for that many hosts."""
    assert argv[:3] == ["python", "-m", "ray_entry.train"], argv[:3]
    cfg = C.load(argv[3:])
    assert cfg.ray_num_workers == workers
    # What JaxTrainer will ask Ray for must be what the cluster has; check() resolves the mesh.
    assert ray_trainer.num_workers(cfg) == workers
    assert ray_trainer.devices_per_worker(cfg) == devices_per_worker
    ray_trainer.check(cfg)
    return cfg


def test_rayjob_entrypoint_matches_the_slice():
    doc = load("maxlite-tpu-rayjob.yaml")[0]
    (group,) = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    chips = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"])
    cfg = check_command(shlex.split(doc["spec"]["entrypoint"]), group["replicas"] * group["numOfHosts"], chips)
    assert cfg.ray_use_tpu and not cfg.ray_use_gpu
    assert cfg.tpu_chips_per_host == chips
    assert cfg.tpu_topology == group["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    assert cfg.tpu_accelerator_type == "TPU-V6E"
    assert cfg.base_output_directory == f"gs://{SAMPLE['GS_BUCKET']}/runs"


def doc_commands() -> list[list[str]]:
    """Every `python -m ray_entry.train` command in the fenced shell blocks of docs/gke.md."""
    commands = []
    for block in re.findall(r"```(?:sh|shell|bash)\n(.*?)```", DOCS.read_text(), re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            if "ray_entry.train" in cmd:
                argv = shlex.split(VAR.sub(lambda m: SAMPLE.get(m.group(1) or m.group(2), "x"), cmd))
                commands.append(argv[argv.index("python"):])
    return commands


def test_docs_commands_are_valid_for_their_cluster():
    commands = doc_commands()
    assert len(commands) >= 2, "docs/gke.md should show the TPU and the GPU submit commands"
    tpu = load("maxlite-tpu-cluster.yaml")[0]["spec"]["workerGroupSpecs"][0]
    gpu = load("maxlite-gpu-cluster.yaml")[0]["spec"]["workerGroupSpecs"][0]
    kinds = set()
    for argv in commands:
        cfg = C.load(argv[3:])
        if cfg.ray_use_tpu:
            check_command(argv, tpu["replicas"] * tpu["numOfHosts"], cfg.tpu_chips_per_host)
            assert cfg.tpu_topology == "4x4" and cfg.tpu_chips_per_host == 4
        elif cfg.ray_use_gpu:
            limit = int(gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
            check_command(argv, gpu["replicas"], limit)
            assert cfg.ray_gpus_per_worker == limit
        else:
            continue
        kinds.add("tpu" if cfg.ray_use_tpu else "gpu")
    assert kinds == {"tpu", "gpu"}
