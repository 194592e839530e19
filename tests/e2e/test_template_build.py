"""Template builds through the official SDK's `Template` builder (and the `aenv build` CLI):
the steps run in a build sandbox, the result is a snapshot, and sandboxes created from the
template are restores of it (the start command is already running)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import BuildException, Sandbox, Template
from e2e_helpers import live_sandbox_ids

from aenv.devserver import ServerProcess

pytestmark = pytest.mark.slow

AENV = str(Path(sys.executable).parent / "aenv")


def _context(tmp: Path) -> Path:
    ctx = tmp / "ctx"
    (ctx / "app" / "lib").mkdir(parents=True)
    (ctx / "hello.txt").write_text("hello from the build context\n")
    (ctx / "app" / "main.py").write_text("print('main')\n")
    (ctx / "app" / "lib" / "util.py").write_text("X = 1\n")
    return ctx


def _templates(api: httpx.Client) -> list[dict[str, object]]:
    resp = api.get("/templates")
    assert resp.status_code == 200, resp.text
    rows: list[dict[str, object]] = resp.json()
    return rows


def test_sdk_build_copy_run_start(tmp_path: Path, api: httpx.Client) -> None:
    ctx = _context(tmp_path)
    name = f"built-{uuid.uuid4().hex[:8]}"
    template = (
        Template(file_context_path=str(ctx))
        .from_template("base")
        .run_cmd("useradd -m -s /bin/bash builder", user="root")
        .set_user("builder")
        .set_workdir("/srv/app")
        .copy("hello.txt", "/srv/app/")
        .copy("app", "/srv/app/code")
        .set_envs({"GREETING": "hi there", "MODE": "test"})
        .run_cmd('echo "$GREETING from $(whoami) in $(pwd)" > built.txt && cat built.txt')
        .set_start_cmd("date +%s > /tmp/started-at && exec python3 -m http.server 8123",
                       "curl -sf http://127.0.0.1:8123/built.txt")
    )
    logs: list[str] = []
    before = live_sandbox_ids(api)
    info = Template.build(template, name, on_build_logs=lambda e: logs.append(e.message))
    try:
        assert info.template_id and info.build_id
        assert any("hi there from builder in /srv/app" in line for line in logs), logs
        assert live_sandbox_ids(api) == before  # the build sandbox is gone
        row = next(t for t in _templates(api) if t["templateID"] == info.template_id)
        assert row["kind"] == "snapshot" and name in row["names"]  # type: ignore[operator]
        assert row["defaultUser"] == "builder"
        assert Template.exists(name)
        got = api.get(f"/templates/{info.template_id}").json()
        assert got["buildStatus"] == "ready" and got["builds"][0]["buildID"] == info.build_id

        created_at = time.time()
        sbx = Sandbox.create(name, timeout=120)
        try:
            # The start command was not run again: it has been running since the build.
            started = int(sbx.files.read("/tmp/started-at").strip())
            assert started < created_at
            served = sbx.commands.run("curl -sf http://127.0.0.1:8123/built.txt")
            assert served.stdout.strip() == "hi there from builder in /srv/app"
            assert sbx.commands.run("whoami").stdout.strip() == "builder"
            assert sbx.commands.run("pwd").stdout.strip() == "/srv/app"
            assert sbx.commands.run("echo $GREETING/$MODE").stdout.strip() == "hi there/test"
            assert sbx.files.read("/srv/app/hello.txt") == "hello from the build context\n"
            assert sbx.files.read("/srv/app/code/lib/util.py") == "X = 1\n"
            owner = sbx.commands.run("stat -c %U /srv/app/hello.txt /srv/app/code/main.py")
            assert owner.stdout.split() == ["builder", "builder"]
            procs = sbx.commands.list()
            assert any("http.server" in " ".join([p.cmd, *p.args]) for p in procs), procs
        finally:
            sbx.kill()
    finally:
        assert api.delete(f"/templates/{info.template_id}").status_code == 204
    assert api.get(f"/templates/aliases/{name}").status_code == 404


def test_failed_run_step_leaves_nothing(tmp_path: Path, api: httpx.Client) -> None:
    name = f"broken-{uuid.uuid4().hex[:8]}"
    template = (Template().from_template("base")
                .run_cmd("echo first step ok")
                .run_cmd("echo about to fail; echo oops >&2; exit 3"))
    before = live_sandbox_ids(api)
    templates_before = {str(t["templateID"]) for t in _templates(api)}
    logs: list[str] = []
    with pytest.raises(BuildException) as failure:
        Template.build(template, name, on_build_logs=lambda e: logs.append(e.message))
    assert "exit code 3" in str(failure.value)
    assert "about to fail" in logs and "oops" in logs, logs
    assert live_sandbox_ids(api) == before
    assert {str(t["templateID"]) for t in _templates(api)} == templates_before
    alias = api.get(f"/templates/aliases/{name}")
    tpl_id = alias.json()["templateID"]  # the requested template is known, with its failed build
    got = api.get(f"/templates/{tpl_id}").json()
    build_id = got["builds"][0]["buildID"]
    status = api.get(f"/templates/{tpl_id}/builds/{build_id}/status").json()
    assert status["status"] == "error"
    assert status["reason"]["step"] == "2"
    assert any(e["message"] == "oops" for e in status["reason"]["logEntries"])
    with pytest.raises(Exception):  # noqa: B017 - the SDK raises its own exception types
        Sandbox.create(name)
    assert api.delete(f"/templates/{tpl_id}").status_code == 204
    assert api.get(f"/templates/{tpl_id}").status_code == 404


def test_cli_build_dockerfile(tmp_path: Path, server: ServerProcess, api: httpx.Client) -> None:
    ctx = _context(tmp_path)
    (ctx / "Dockerfile").write_text(
        "FROM base\n"
        "ARG WHO=world\n"
        "ENV APP_MODE=prod\n"
        "WORKDIR /opt/app\n"
        "COPY hello.txt ./\n"
        "COPY app/ ./app/\n"
        "RUN echo \"hello $WHO\" > greeting.txt \\\n"
        "    && ls app > listing.txt\n"
        "USER root\n"
        'CMD ["python3", "-m", "http.server", "8124"]\n')
    name = f"cli-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update({"AENV_URL": server.url, "AENV_API_KEY": server.api_key,
                "XDG_CONFIG_HOME": str(tmp_path / "config"), "NO_PROXY": "127.0.0.1,localhost"})
    proc = subprocess.run([AENV, "build", str(ctx / "Dockerfile"), "--name", name,
                           "--ready-cmd", "curl -sf http://127.0.0.1:8124/"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    tpl_id = api.get(f"/templates/aliases/{name}").json()["templateID"]
    try:
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert sbx.commands.run("cat greeting.txt").stdout.strip() == "hello world"
            assert sbx.commands.run("cat listing.txt").stdout.split() == ["lib", "main.py"]
            assert sbx.commands.run("echo $APP_MODE; whoami; pwd").stdout.split() == [
                "prod", "root", "/opt/app"]
            assert sbx.commands.run("curl -sf -o /dev/null http://127.0.0.1:8124/hello.txt"
                                    ).exit_code == 0
        finally:
            sbx.kill()
        ls = subprocess.run([AENV, "template", "ls", "-o", "json"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
        assert name in {n for row in json.loads(ls.stdout) for n in row["names"]}
        # A failing build: a clean error naming the step, no traceback.
        (ctx / "Dockerfile.bad").write_text("FROM base\nRUN exit 7\n")
        bad = subprocess.run([AENV, "build", str(ctx / "Dockerfile.bad"), "--name", name + "-bad"],
                             env=env, capture_output=True, text=True, timeout=300, check=False)
        assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
        assert "exit code 7" in bad.stderr, bad.stderr
        missing = subprocess.run([AENV, "build", str(tmp_path / "nope"), "--name", "x"], env=env,
                                 capture_output=True, text=True, timeout=60, check=False)
        assert missing.returncode == 1 and "Traceback" not in missing.stderr
    finally:
        subprocess.run([AENV, "template", "rm", name], env=env, capture_output=True, timeout=60,
                       check=False)
        api.delete(f"/templates/{name}-bad")
    assert api.get(f"/templates/{tpl_id}").status_code == 404


async def test_async_sdk_rebuild_replaces(tmp_path: Path, api: httpx.Client) -> None:
    """AsyncTemplate, build_in_background + get_build_status, fromImage naming an existing
    template, and a rebuild under the same name replacing the template (and its snapshot)."""
    from e2b import AsyncSandbox, AsyncTemplate, TemplateBuildStatus

    name = f"rebuilt-{uuid.uuid4().hex[:8]}"
    snapshots_before = len(api.get("/snapshots").json())
    ids = []
    for version in ("one", "two"):
        template = AsyncTemplate().from_image("base").run_cmd(f"echo {version} > /tmp/version")
        info = await AsyncTemplate.build_in_background(template, name)
        deadline = time.monotonic() + 120
        while True:
            status = await AsyncTemplate.get_build_status(info)
            if status.status not in (TemplateBuildStatus.BUILDING, TemplateBuildStatus.WAITING):
                break
            assert time.monotonic() < deadline, "build did not finish"
            await asyncio.sleep(0.2)
        assert status.status == TemplateBuildStatus.READY, status
        ids.append(info.template_id)
        sbx = await AsyncSandbox.create(name, timeout=60)
        try:
            assert (await sbx.files.read("/tmp/version")).strip() == version
        finally:
            await sbx.kill()
    assert ids[0] == ids[1]  # the name keeps its template id
    snapshots = api.get("/snapshots").json()
    assert len(snapshots) == snapshots_before + 1  # the first build's snapshot is gone
    assert ids[0] in {s["snapshotID"] for s in snapshots}
    assert len([t for t in _templates(api) if name in t["names"]]) == 1  # type: ignore[operator]
    assert api.delete(f"/templates/{name}").status_code == 204
