"""The rest of E2B's templates API through the official SDK (`Template`, and its generated
client for calls the `Template` class has no method for): `GET /v2/templates`, `PATCH
/templates/{id}` and `/v2/templates/{id}`, tags, and the build cache (`skip_cache`).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b import ConnectionConfig, Sandbox, Template, TemplateException
from e2b.api.client.api.templates import (
    get_default_templates,
    get_v2_templates,
    patch_templates_template_id,
    patch_v_2_templates_template_id,
)
from e2b.api.client.models import TemplateUpdateRequest
from e2b.api.client_sync import get_api_client
from e2e_helpers import assert_json_error


@pytest.fixture(scope="module")
def client() -> Iterator[object]:
    yield get_api_client(ConnectionConfig())


def _build(template: Template, name: str, **kw: object) -> list[str]:
    logs: list[str] = []
    Template.build(template, name, on_build_logs=lambda e: logs.append(e.message),
                   **kw)  # type: ignore[arg-type]
    return logs


@pytest.fixture(scope="module")
def built(api: httpx.Client) -> Iterator[str]:
    """A template of two RUN steps, the second of which leaves a unique stamp."""
    name = f"tplapi-{uuid.uuid4().hex[:8]}"
    logs = _build(Template().from_template("base")
                  .run_cmd("echo one > /tmp/one", user="root")
                  .run_cmd("cat /proc/sys/kernel/random/uuid > /tmp/stamp", user="root"),
                  name, tags=["v1"])
    assert not any(line.startswith("CACHED") for line in logs), logs
    try:
        yield name
    finally:
        api.delete(f"/templates/{name}")


def _stamp(template: str) -> str:
    sbx = Sandbox.create(template, timeout=60)
    try:
        return sbx.files.read("/tmp/stamp").strip()
    finally:
        sbx.kill()


def test_tags(built: str, api: httpx.Client) -> None:
    tags = {t.tag for t in Template.get_tags(built)}
    assert tags == {"default", "v1"}
    info = Template.assign_tags(f"{built}:v1", ["stable", "prod"])
    assert set(info.tags) == {"stable", "prod"}
    listed = Template.get_tags(built)
    assert {t.tag for t in listed} == {"default", "v1", "stable", "prod"}
    assert {str(t.build_id) for t in listed} == {info.build_id}  # one build, all its tags
    # name:tag names the template while the tag exists
    sbx = Sandbox.create(f"{built}:stable", timeout=60)
    sbx.kill()
    Template.remove_tags(built, "stable")
    assert "stable" not in {t.tag for t in Template.get_tags(built)}
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(f"{built}:stable", timeout=60)
    assert api.get(f"/templates/{built}/tags/count").json() == {"total": 3}
    assert api.get(f"/templates/{built}/tags/exists", params={"tag": "prod"}).json()[
        "exists"] is True
    with pytest.raises(TemplateException):
        Template.remove_tags(built, "default")
    with pytest.raises(TemplateException):
        Template.remove_tags(built, "never-assigned")
    assert_json_error(api.post("/templates/tags", json={"target": f"{built}:v1",
                                                        "tags": ["bad tag!"]}), 400)
    assert_json_error(api.post("/templates/tags", json={"target": "no-such-template:x",
                                                        "tags": ["a"]}), 404)


def test_build_cache_reuses_unchanged_steps_and_skip_cache_forces(built: str) -> None:
    stamp = _stamp(built)
    # The same steps and one more: the first two are not run again.
    logs = _build(Template().from_template("base")
                  .run_cmd("echo one > /tmp/one", user="root")
                  .run_cmd("cat /proc/sys/kernel/random/uuid > /tmp/stamp", user="root")
                  .run_cmd("echo three > /tmp/three", user="root"), built)
    cached = [line for line in logs if line.startswith("CACHED")]
    assert len(cached) == 2, logs
    assert any("[3/3]" in line and not line.startswith("CACHED") for line in logs), logs
    sbx = Sandbox.create(built, timeout=60)
    try:
        assert sbx.files.read("/tmp/stamp").strip() == stamp  # not run again
        assert sbx.files.read("/tmp/three").strip() == "three"
    finally:
        sbx.kill()
    # A changed step runs again, with every step after it.
    logs = _build(Template().from_template("base")
                  .run_cmd("echo one > /tmp/one", user="root")
                  .run_cmd("cat /proc/sys/kernel/random/uuid > /tmp/stamp && echo changed",
                           user="root")
                  .run_cmd("echo three > /tmp/three", user="root"), built)
    ran = [line for line in logs if not line.startswith("CACHED")]
    assert any("[2/3]" in line for line in ran) and any("[3/3]" in line for line in ran), logs
    changed = _stamp(built)
    assert changed != stamp
    # skip_cache: every step runs.
    logs = _build(Template().from_template("base")
                  .run_cmd("echo one > /tmp/one", user="root")
                  .run_cmd("cat /proc/sys/kernel/random/uuid > /tmp/stamp && echo changed",
                           user="root")
                  .run_cmd("echo three > /tmp/three", user="root"), built, skip_cache=True)
    assert not any(line.startswith("CACHED") for line in logs), logs
    assert _stamp(built) != changed
    # The tags of the build a rebuild replaced went with it (aenv keeps one build).
    assert {t.tag for t in Template.get_tags(built)} == {"default"}


def test_list_v2_and_patch(built: str, client: object, api: httpx.Client) -> None:
    res = get_v2_templates.sync_detailed(client=client, limit=1)  # type: ignore[arg-type]
    assert res.status_code == 200 and isinstance(res.parsed, list) and len(res.parsed) == 1
    token = res.headers.get("x-next-token")
    assert token  # more than one template on this server (base, and ours)
    names: list[str] = []
    page = api.get("/v2/templates", params={"limit": 1000}).json()
    names = [n for t in page for n in t["names"]]
    assert built in names and "base" in names
    mine = next(t for t in page if built in t["names"])
    assert mine["public"] is False

    v2 = patch_v_2_templates_template_id.sync_detailed(
        mine["templateID"], client=client,  # type: ignore[arg-type]
        body=TemplateUpdateRequest(public=True))
    assert v2.status_code == 200, v2.content
    assert v2.parsed is not None and built in v2.parsed.names  # type: ignore[union-attr]
    assert api.get(f"/templates/{built}").json()["public"] is True
    v1 = patch_templates_template_id.sync_detailed(
        built, client=client, body=TemplateUpdateRequest(public=False))  # type: ignore[arg-type]
    assert v1.status_code == 200
    assert next(t for t in api.get("/v2/templates", params={"limit": 1000}).json()
                if built in t["names"])["public"] is False
    assert_json_error(api.patch(f"/templates/{built}", json={"public": "yes"}), 400)
    assert_json_error(api.patch("/v2/templates/no-such-template", json={"public": True}), 404)
    assert_json_error(api.get("/v2/templates", params={"limit": "0"}), 400)
    defaults = get_default_templates.sync_detailed(client=client)  # type: ignore[arg-type]
    assert defaults.status_code == 200 and isinstance(defaults.parsed, list)
    assert any("base" in t.names and t.is_default for t in defaults.parsed)
    assert not any(built in t.names for t in defaults.parsed)
