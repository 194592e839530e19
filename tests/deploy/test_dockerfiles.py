"""deploy/docker/Dockerfile.{node,control}: parsed with dockerfile-parse and linted with our
rules (multi-stage, pinned base images, every COPY source in the build context and not
excluded by .dockerignore, no compilers in the final stage, a HEALTHCHECK, exec-form entry
points, a non-root USER for the control image), and with hadolint (its wheel ships the
binary). No image is built here: there is no Docker engine (docs/deploy.md)."""

from __future__ import annotations

import io
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deploy_support import DEPLOY, REPO, run, tool
from dockerfile_parse import DockerfileParser

DOCKER = DEPLOY / "docker"
NODE = DOCKER / "Dockerfile.node"
CONTROL = DOCKER / "Dockerfile.control"
COMPILERS = re.compile(r"^(build-essential|gcc(-\d+)?|g\+\+(-\d+)?|cpp(-\d+)?|clang(-\d+)?|make|cmake|"
                       r"binutils|pkg-config|golang(-go)?|rustc|cargo|.*-dev)$")
PINNED_TAG = re.compile(r"\d{8}|\d+\.\d+")


@dataclass
class Stage:
    name: str | None
    image: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, value)


def parse(text: str) -> list[Stage]:
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in parser.structure:
        kind, value = ins["instruction"], ins["value"]
        if kind == "COMMENT":
            continue
        if kind == "ARG" and not stages:
            name, _, default = value.partition("=")
            global_args[name] = default
        elif kind == "FROM":
            words = value.split()
            words = [w for w in words if not w.startswith("--platform")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m[1], m[0]), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(name, image))
        elif stages:
            stages[-1].instructions.append((kind, value))
    return stages


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (relative, /-separated) out of the build context:
    the last pattern matching it or one of its parent directories wins; `!` re-includes."""
    def regex(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + r"\Z")

    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip().strip("/")
        rx = regex(pattern)
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


def read_dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.strip().startswith("#")]


def copy_sources(value: str) -> tuple[dict[str, str], list[str]]:
    """(flags, sources) of a COPY/ADD value, shell or JSON form."""
    words = shlex.split(value)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, val = words.pop(0)[2:].partition("=")
        flags[key] = val
    rest = " ".join(words)
    if rest.startswith("["):
        words = json.loads(rest)
    return flags, words[:-1]


def apt_installs(run_value: str) -> list[str]:
    """Packages of every `apt-get install` in a RUN."""
    out = []
    for part in re.split(r"&&|;|\|\|", run_value):
        words = part.replace("\\", " ").split()
        if len(words) >= 2 and words[0] == "apt-get" and "install" in words:
            out += [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
    return out


def lint(text: str, context: Path, non_root: bool) -> list[str]:
    problems: list[str] = []
    stages = parse(text)
    if len(stages) < 2:
        problems.append("not multi-stage: a builder stage and a runtime stage")
    names = set()
    ignore = read_dockerignore(context)
    for stage in stages:
        if stage.image not in names:
            image, _, digest = stage.image.partition("@")
            tag = image.rpartition(":")[2] if ":" in image.rpartition("/")[2] else ""
            if not digest and not PINNED_TAG.search(tag):
                problems.append(f"base image {stage.image} is not pinned (a dated or versioned tag, or @sha256)")
        for kind, value in stage.instructions:
            if kind not in ("COPY", "ADD"):
                continue
            flags, sources = copy_sources(value)
            if "from" in flags:
                if flags["from"] not in names:
                    problems.append(f"{kind} --from={flags['from']}: no such earlier stage")
                continue
            for src in sources:
                found = sorted(context.glob(src)) if any(c in src for c in "*?[") else [context / src]
                if not found or not all(p.exists() for p in found):
                    problems.append(f"{kind} {src}: not in the build context")
                for p in found:
                    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
                    rel = [str(f.relative_to(context)) for f in files]
                    if rel and all(dockerignore_excludes(r, ignore) for r in rel):
                        problems.append(f"{kind} {src}: excluded by .dockerignore")
        if stage.name:
            names.add(stage.name)
    final = stages[-1] if stages else Stage(None, "")
    for kind, value in final.instructions:
        if kind == "RUN":
            bad = [p for p in apt_installs(value) if COMPILERS.match(p)]
            if bad:
                problems.append(f"final stage installs build tools: {bad}")
    kinds = [k for k, _ in final.instructions]
    health = [v for k, v in final.instructions if k == "HEALTHCHECK"]
    if not health or health[-1].strip().upper() == "NONE":
        problems.append("final stage has no HEALTHCHECK")
    for k, v in final.instructions:
        if k in ("ENTRYPOINT", "CMD") and not v.strip().startswith("["):
            problems.append(f"{k} in shell form (signals would go to a shell): {v}")
    if "ENTRYPOINT" not in kinds and "CMD" not in kinds:
        problems.append("final stage has no ENTRYPOINT or CMD")
    users = [v.split(":")[0] for k, v in final.instructions if k == "USER"]
    if non_root and (not users or users[-1] in ("0", "root")):
        problems.append("final stage runs as root (needs a non-root USER)")
    return problems


@pytest.mark.parametrize(("path", "non_root"), [(NODE, False), (CONTROL, True)], ids=["node", "control"])
def test_lint(path: Path, non_root: bool) -> None:
    assert lint(path.read_text(), REPO, non_root) == []


def test_node_image_has_the_runtime_packages() -> None:
    """What install.sh installs on a node host (the Makefile's APT_PACKAGES less test-only
    tools and etcd) is in the node image, less binutils (`strip`: optional) and the venv module
    (the image's virtualenv is made in the builder stage)."""
    host = run(["bash", str(REPO / "scripts/install.sh"), "--print-apt-packages"]).stdout.split()
    wanted = set(host) - {"binutils", "python3.11", "python3.11-venv"}
    final = parse(NODE.read_text())[-1]
    installed = {p for k, v in final.instructions if k == "RUN" for p in apt_installs(v)}
    assert wanted <= installed, (
        f"missing in Dockerfile.node: {sorted(wanted - installed)} (a runtime dependency belongs "
        "in the image; a test or cluster-simulation tool in scripts/install.sh's APT_TEST_ONLY)")
    assert {"python3", "tini", "libprotobuf-c1", "libnl-3-200", "libnet1"} <= installed


def test_entry_points() -> None:
    for path, cmd in ((NODE, ["aenv", "serve"]),
                      (CONTROL, ["aenv", "gateway", "--etcd", "http://etcd:2379", "--listen", "0.0.0.0:8080"])):
        final = dict(parse(path.read_text())[-1].instructions)
        assert json.loads(final["ENTRYPOINT"]) == ["/usr/bin/tini", "--", "/usr/local/bin/aenv-entrypoint"]
        assert json.loads(final["CMD"]) == cmd


def test_lint_catches_a_broken_dockerfile(tmp_path: Path) -> None:
    (tmp_path / "present.txt").write_text("x")
    (tmp_path / "secret.key").write_text("x")
    (tmp_path / ".dockerignore").write_text("*.key\n")
    broken = (
        "FROM debian:latest\n"
        "COPY present.txt missing.txt /app/\n"
        "COPY secret.key /app/\n"
        "COPY --from=nowhere /x /x\n"
        "RUN apt-get update && apt-get install -y gcc libssl-dev make\n"
        "CMD aenv serve\n"
    )
    problems = lint(broken, tmp_path, non_root=True)
    expected = ["not multi-stage", "debian:latest is not pinned", "missing.txt: not in the build context",
                "secret.key: excluded by .dockerignore", "--from=nowhere", "build tools",
                "no HEALTHCHECK", "shell form", "runs as root"]
    for want in expected:
        assert any(want in p for p in problems), f"{want!r} not reported: {problems}"
    assert not any("present.txt" in p for p in problems)


def test_dockerignore_matching() -> None:
    patterns = read_dockerignore(REPO)
    assert dockerignore_excludes(".venv/bin/python", patterns)
    assert dockerignore_excludes("tests/conftest.py", patterns)
    assert dockerignore_excludes("src/aenv/__pycache__/config.cpython-311.pyc", patterns)
    assert not dockerignore_excludes("src/aenv/config.py", patterns)
    assert not dockerignore_excludes("scripts/criu-empty-tmpfs.patch", patterns)
    assert dockerignore_excludes("scripts/demo.py", patterns)


@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint not installed")
@pytest.mark.parametrize("path", [NODE, CONTROL], ids=["node", "control"])
def test_hadolint(path: Path) -> None:
    hadolint = tool("hadolint")
    assert hadolint
    proc = run([hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(path)], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint not installed")
def test_hadolint_fails_on_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = tool("hadolint")
    assert hadolint
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN cd /tmp && apt-get install curl\n")
    proc = run([hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(bad)], check=False)
    assert proc.returncode != 0 and "DL3007" in proc.stdout  # `latest`
