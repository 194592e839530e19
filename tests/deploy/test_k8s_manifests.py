"""deploy/k8s: every manifest parsed and validated against the Kubernetes API's JSON schemas
offline (kubernetes-validate bundles them; strict: unknown fields are errors), the kustomize
build, and what the deployment relies on (probes, requests, selectors, the node DaemonSet)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_support import DEPLOY, run

K8S = DEPLOY / "k8s"
# The oldest and the newest API versions the manifests must be valid for.
VERSIONS = ("1.29.0", "1.33.0")
Doc = dict[str, Any]


def load(path: Any) -> list[Doc]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kustomization() -> Doc:
    return load(K8S / "kustomization.yaml")[0]


def resources() -> list[Doc]:
    return [d for name in kustomization()["resources"] for d in load(K8S / name)]


def rendered() -> list[Doc]:
    """`kubectl kustomize` output when kubectl is here, else the resources with the
    kustomization's namespace and images applied the same way."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        return [d for d in yaml.safe_load_all(run([kubectl, "kustomize", str(K8S)]).stdout) if d]
    k = kustomization()
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in k.get("images", [])}
    out = []
    for d in resources():
        if d["kind"] != "Namespace":
            d.setdefault("metadata", {})["namespace"] = k["namespace"]
        for c in containers(d):
            c["image"] = images.get(c["image"], c["image"])
        out.append(d)
    return out


def pod_spec(d: Doc) -> Doc | None:
    if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        spec: Doc = d["spec"]["template"]["spec"]
        return spec
    return None


def containers(d: Doc) -> Iterator[Doc]:
    spec = pod_spec(d)
    if spec:
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


def by_name(docs: list[Doc], kind: str, name: str) -> Doc:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name}")


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid(version: str) -> None:
    docs = resources()
    assert len(docs) >= 15
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_kustomization_is_valid(version: str) -> None:
    docs = rendered()
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)
    namespaced = [d for d in docs if d["kind"] != "Namespace"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"aenv"}
    for d in docs:
        for c in containers(d):
            assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


def test_the_validator_rejects_a_broken_manifest() -> None:
    gateway = by_name(resources(), "Deployment", "aenv-gateway")
    typo: Doc = yaml.safe_load(yaml.safe_dump(gateway))
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSIONS[0], strict=True)
    wrong_type: Doc = yaml.safe_load(yaml.safe_dump(gateway))
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong_type, VERSIONS[0], strict=True)


def test_every_container_has_requests_and_probes() -> None:
    for d in resources():
        for c in containers(d):
            where = f"{d['kind']} {d['metadata']['name']}/{c['name']}"
            assert {"cpu", "memory"} <= set(c.get("resources", {}).get("requests", {})), where
            assert "readinessProbe" in c and "livenessProbe" in c, where


def test_aenv_probes_use_health() -> None:
    for name, kind in (("aenv-gateway", "Deployment"), ("aenv-scheduler", "Deployment"), ("aenv-node", "DaemonSet")):
        (c,) = containers(by_name(resources(), kind, name))
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] == "/health", (name, probe)


def test_selectors_match_pods() -> None:
    """Services, PDBs and the HPA point at workloads that exist."""
    docs = resources()
    workloads = [d for d in docs if pod_spec(d)]

    def matches(selector: dict[str, str]) -> list[str]:
        return [w["metadata"]["name"] for w in workloads
                if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]

    for d in docs:
        if d["kind"] == "Service":
            assert matches(d["spec"]["selector"]), d["metadata"]["name"]
        if d["kind"] == "PodDisruptionBudget":
            assert matches(d["spec"]["selector"]["matchLabels"]), d["metadata"]["name"]
    for w in workloads:
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    hpa = by_name(docs, "HorizontalPodAutoscaler", "aenv-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert by_name(docs, target["kind"], target["name"])
    assert "replicas" not in by_name(docs, "Deployment", "aenv-gateway")["spec"]  # the HPA's


def test_references_exist() -> None:
    """ConfigMaps, Secrets and ServiceAccounts the pods name are defined here."""
    docs = resources()
    defined = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for d in docs:
        spec = pod_spec(d)
        if not spec:
            continue
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", spec["serviceAccountName"]) in defined
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in defined
        for c in containers(d):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    assert ("ConfigMap", ref["configMapKeyRef"]["name"]) in defined
                if "secretKeyRef" in ref:
                    assert ("Secret", ref["secretKeyRef"]["name"]) in defined


def test_node_daemonset() -> None:
    ds = by_name(resources(), "DaemonSet", "aenv-node")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"aenv.dev/node": "true"}
    assert spec["hostNetwork"] and spec["hostPID"]
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"  # resolves etcd-0.etcd on the host network
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"
    (c,) = spec["containers"]
    assert c["securityContext"]["privileged"] is True
    assert c["args"][:2] == ["aenv", "serve"] and "--cluster" in c["args"] and "--advertise" in c["args"]
    host_paths = {v["hostPath"]["path"]: v["name"] for v in spec["volumes"] if "hostPath" in v}
    assert {"/var/lib/aenv", "/sys/fs/cgroup", "/opt/aenv/runtime", "/dev"} <= set(host_paths)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts[host_paths["/var/lib/aenv"]]["mountPath"] == "/var/lib/aenv"
    assert mounts[host_paths["/var/lib/aenv"]]["mountPropagation"] == "Bidirectional"
    assert mounts[host_paths["/sys/fs/cgroup"]]["mountPath"] == "/sys/fs/cgroup"
    assert "startupProbe" in c


def test_control_plane() -> None:
    docs = resources()
    sched = by_name(docs, "Deployment", "aenv-scheduler")
    assert sched["spec"]["replicas"] >= 2  # a leader and a standby
    (c,) = containers(sched)
    assert c["args"][:2] == ["aenv", "scheduler"]
    assert c["args"][c["args"].index("--listen") + 1] == "0.0.0.0:9090"
    assert "--etcd" in c["args"] and "--advertise" in c["args"]
    (g,) = containers(by_name(docs, "Deployment", "aenv-gateway"))
    assert g["args"] == ["aenv", "gateway", "--etcd", "$(ETCD_URL)", "--listen", "0.0.0.0:8080"]
    svc = by_name(docs, "Service", "aenv-gateway")
    assert svc["spec"]["ports"][0]["port"] == 8080
    for w in (sched, by_name(docs, "Deployment", "aenv-gateway")):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (c,) = pod["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "Secret", "PodDisruptionBudget",
            "StatefulSet", "HorizontalPodAutoscaler"} <= kinds
    etcd = by_name(docs, "StatefulSet", "etcd")
    assert by_name(docs, "Service", etcd["spec"]["serviceName"])["spec"]["clusterIP"] == "None"


def test_api_key_is_a_placeholder() -> None:
    secret = by_name(resources(), "Secret", "aenv-api-key")
    assert "REPLACE-ME" in secret["stringData"]["api-key"]
