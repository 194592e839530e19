"""deploy/compose.yaml against the Compose Specification's JSON schema (vendored:
compose-spec.json, see compose-spec.SOURCE.md), and what the cluster relies on."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from deploy_support import DEPLOY, REPO, run

COMPOSE = DEPLOY / "compose.yaml"
SCHEMA = Path(__file__).with_name("compose-spec.json")


def load() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())  # resolves the << merge keys
    return doc


def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def errors(doc: dict[str, Any]) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in validator().iter_errors(doc)]


def test_valid_against_the_compose_spec() -> None:
    assert errors(load()) == []


def test_the_schema_rejects_broken_files() -> None:
    doc = load()
    typo = copy.deepcopy(doc)
    typo["services"]["node1"]["privilegd"] = True
    assert any("privilegd" in e for e in errors(typo))
    wrong = copy.deepcopy(doc)
    wrong["services"]["gateway"]["ports"] = {"8080": "8080"}
    assert errors(wrong)


def test_services() -> None:
    services = load()["services"]
    assert set(services) == {"etcd", "scheduler", "gateway", "node1", "node2"}
    gw = services["gateway"]
    assert gw["command"] == ["aenv", "gateway", "--etcd", "http://etcd:2379", "--listen", "0.0.0.0:8080"]
    assert "8080:8080" in gw["ports"]
    sched = services["scheduler"]["command"]
    assert sched[:6] == ["aenv", "scheduler", "--etcd", "http://etcd:2379", "--listen", "0.0.0.0:9090"]
    assert "--advertise" in sched  # others reach it by its service name, not 127.0.0.1
    for name in ("node1", "node2"):
        node = services[name]
        assert node["privileged"] is True and node["cgroup"] == "private"
        assert node["command"] == ["aenv", "serve", "--cluster", "http://etcd:2379",
                                   "--advertise", f"http://{name}:8000"]
        assert node["depends_on"]["etcd"]["condition"] == "service_healthy"
        assert node["environment"]["AENV_LISTEN"] == "0.0.0.0:8000"
        homes = [v for v in node["volumes"] if v.endswith(":/var/lib/aenv")]
        assert homes == [f"{name}-home:/var/lib/aenv"]  # a home each, not on the image's overlay


def test_shared_repository_and_secret() -> None:
    doc = load()
    nodes = [doc["services"][n] for n in ("node1", "node2")]
    path = nodes[0]["environment"]["AENV_SNAPSHOT_PATH"]
    for node in nodes:
        assert node["environment"]["AENV_SNAPSHOT_BACKEND"] == "posix_fs"
        assert f"repository:{path}" in node["volumes"]
    assert "repository" in doc["volumes"]
    assert doc["secrets"]["aenv_api_key"]["file"] == "./secrets/api_key"
    for name, svc in doc["services"].items():
        if name == "etcd":
            continue
        assert "aenv_api_key" in svc["secrets"], name
        assert svc["environment"]["AENV_API_KEY_FILE"] == "/run/secrets/aenv_api_key", name


def test_references_are_declared() -> None:
    """What `docker compose config` would refuse beyond the schema: undeclared named volumes,
    secrets or dependencies."""
    doc = load()
    for name, svc in doc["services"].items():
        for vol in svc.get("volumes", []):
            source = vol.split(":", 1)[0]
            if not source.startswith(("/", ".")):
                assert source in doc["volumes"], f"{name}: volume {source} is not declared"
        for secret in svc.get("secrets", []):
            assert secret in doc["secrets"], f"{name}: secret {secret} is not declared"
        for dep in svc.get("depends_on", {}):
            assert dep in doc["services"], f"{name}: depends on unknown {dep}"
            if svc["depends_on"][dep].get("condition") == "service_healthy":
                assert "healthcheck" in doc["services"][dep], f"{name}: {dep} has no healthcheck"


def test_builds_point_at_files_that_exist() -> None:
    for name, svc in load()["services"].items():
        if "build" not in svc:
            continue
        context = (COMPOSE.parent / svc["build"]["context"]).resolve()
        assert context == REPO, name
        assert (context / svc["build"]["dockerfile"]).is_file(), name


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client")
def test_docker_compose_config(tmp_path: Path) -> None:
    """`docker compose config` when the Compose plugin is installed (it needs no engine)."""
    if run(["docker", "compose", "version"], check=False).returncode != 0:
        pytest.skip("the docker client has no compose plugin here")
    secrets = DEPLOY / "secrets"
    created = not secrets.exists()
    secrets.mkdir(exist_ok=True)
    key = secrets / "api_key"
    made_key = not key.exists()
    if made_key:
        key.write_text("test-key\n")
    try:
        run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"])
    finally:
        if made_key:
            key.unlink()
        if created:
            secrets.rmdir()
