"""scripts/install.sh on this machine, into a temporary prefix and root: install, install again
(nothing changes), upgrade, uninstall (state kept), purge; files, modes, the units.

The script runs from a copy of the repository (so edits made meanwhile in the work tree do not
change what the two runs see) with --no-apt --no-criu --no-systemctl: apt and CRIU are what
`make install` already did on this host, and systemctl would act on the real system.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_support import DEPLOY, REPO, run

UNITS = ("aenv", "aenv-gateway", "aenv-scheduler")
NO_HOST_STEPS = ["--no-apt", "--no-criu", "--no-systemctl"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="install.sh needs root")


@dataclass
class Install:
    tree: Path  # the copy of the repository the script runs from
    root: Path  # --root
    prefix: Path  # --prefix
    first: subprocess.CompletedProcess[str]

    def script(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run(["bash", str(self.tree / "scripts/install.sh"), "--root", str(self.root),
                    "--prefix", str(self.prefix), *NO_HOST_STEPS, *args], check=check)

    def at(self, path: str) -> Path:
        return self.root / path.lstrip("/")


def copy_tree(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    dest.mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(REPO / name, dest / name)
    for name in ("src", "scripts", "deploy"):
        shutil.copytree(REPO / name, dest / name, ignore=ignore, symlinks=True)
    return dest


def fake_root(root: Path) -> Path:
    """A root with the account databases `useradd --prefix` edits."""
    etc = root / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    for name in ("shadow", "gshadow"):
        (etc / name).chmod(0o640)
    return root


@pytest.fixture(scope="module")
def inst(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    base = tmp_path_factory.mktemp("install")
    tree = copy_tree(base / "tree")
    root = fake_root(base / "root")
    prefix = base / "prefix"
    first = run(["bash", str(tree / "scripts/install.sh"), "--root", str(root), "--prefix",
                 str(prefix), *NO_HOST_STEPS])
    yield Install(tree, root, prefix, first)
    # A mount left by a failed test would keep the tree from being removed.
    subprocess.run(["umount", "-q", str(root / "var/lib/aenv/volume")], check=False,
                   capture_output=True)
    shutil.rmtree(base, ignore_errors=True)  # two virtualenvs and a bundle: ~200 MB


def snapshot(*dirs: Path) -> dict[str, tuple[object, ...]]:
    """Everything under dirs: type, contents' sha256 or link target, mode, owner."""
    out: dict[str, tuple[object, ...]] = {}
    for top in dirs:
        if not top.exists():
            continue
        for path in [top, *sorted(top.rglob("*"))]:
            st = path.lstat()
            ident = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if path.is_symlink():
                out[str(path)] = ("link", os.readlink(path), *ident)
            elif path.is_dir():
                out[str(path)] = ("dir", *ident)
            else:
                out[str(path)] = ("file", hashlib.sha256(path.read_bytes()).hexdigest(), *ident)
    return out


def report_lines(output: str) -> list[tuple[str, str]]:
    """(status, path) of every `install.sh: <status>: <path>` line."""
    return [(m[1], m[2]) for m in re.finditer(r"^install\.sh: ([^:]+): (.+)$", output, re.MULTILINE)]


def unit_settings(text: str) -> dict[str, list[str]]:
    """`Section.Key` -> values, in order (systemd allows a key more than once)."""
    section = ""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def aenv_gid(inst: Install) -> int:
    for line in inst.at("/etc/group").read_text().splitlines():
        name, _, gid, _ = line.split(":")
        if name == "aenv":
            return int(gid)
    raise AssertionError("no aenv group in the root's /etc/group")


# -- the first run -----------------------------------------------------------------------------

def test_first_run_installs_everything(inst: Install) -> None:
    out = inst.first.stdout
    assert "changed" in out.splitlines()[-1]
    lib = inst.prefix / "lib/aenv"
    expected = [
        inst.prefix / "bin/aenv", lib / "current", lib / "aenv-health",
        inst.at("/etc/aenv/config.toml"), inst.at("/etc/aenv/aenv.env"),
        inst.at("/var/lib/aenv"), inst.at("/opt/aenv/runtime/py311/.complete"),
        *(inst.at(f"/etc/systemd/system/{u}.service") for u in UNITS),
    ]
    missing = [str(p) for p in expected if not p.exists()]
    assert not missing, f"not installed: {missing}\n{out}"
    assert (lib / "current").is_symlink() and os.readlink(lib / "current").startswith("venv-")
    assert os.readlink(inst.prefix / "bin/aenv") == "../lib/aenv/current/bin/aenv"
    # Nothing is written outside the prefix and the root: the real /etc is not touched.
    assert str(inst.root) in out and "/etc/systemd/system/aenv.service" in out
    assert not any(path.startswith(("/etc/", "/var/lib/", "/usr/local/")) for _, path in report_lines(out))


def test_modes_and_owners(inst: Install) -> None:
    def meta(p: Path) -> tuple[int, int, int]:
        st = p.stat()
        return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid

    gid = aenv_gid(inst)
    assert meta(inst.at("/var/lib/aenv")) == (0o700, 0, 0)
    assert meta(inst.at("/etc/aenv/config.toml")) == (0o640, 0, gid)  # the aenv services read it
    assert meta(inst.at("/etc/aenv/aenv.env")) == (0o600, 0, 0)  # systemd reads it, as root
    assert meta(inst.at("/etc/aenv")) == (0o755, 0, 0)
    for u in UNITS:
        assert meta(inst.at(f"/etc/systemd/system/{u}.service")) == (0o644, 0, 0)
    assert meta(inst.prefix / "lib/aenv/aenv-health") == (0o755, 0, 0)


def test_aenv_user(inst: Install) -> None:
    users = {line.split(":")[0]: line.split(":") for line in inst.at("/etc/passwd").read_text().splitlines()}
    assert "aenv" in users
    _, _, uid, _, _, home, shell = users["aenv"]
    assert int(uid) < 1000 and home == "/nonexistent" and shell == "/usr/sbin/nologin"


def test_config_files_are_the_templates(inst: Install) -> None:
    assert inst.at("/etc/aenv/config.toml").read_bytes() == (DEPLOY / "config.toml").read_bytes()
    assert inst.at("/etc/aenv/aenv.env").read_bytes() == (DEPLOY / "aenv.env").read_bytes()


def test_installed_command_runs(inst: Install) -> None:
    aenv = str(inst.prefix / "bin/aenv")
    out = run([aenv, "--help"]).stdout
    assert "serve" in out
    assert "--listen" in run([aenv, "serve", "--help"]).stdout
    # The runtime bundle was built by the installed venv and works.
    run([str(inst.prefix / "lib/aenv/current/bin/python"), "-m", "aenv.runtime.pybundle", "check",
         "--dest", str(inst.at("/opt/aenv/runtime/py311"))])


def test_units_use_flags_the_cli_accepts(inst: Install) -> None:
    """Every flag the units pass exists in the installed `aenv` (the cluster sub-commands are
    checked once this tree has them)."""
    aenv = str(inst.prefix / "bin/aenv")
    subcommands = run([aenv, "--help"]).stdout
    for unit, sub in (("aenv", "serve"), ("aenv-gateway", "gateway"), ("aenv-scheduler", "scheduler")):
        exec_start = unit_settings(inst.at(f"/etc/systemd/system/{unit}.service").read_text())["Service.ExecStart"][0]
        assert exec_start.startswith(f"{inst.prefix}/bin/aenv {sub}")
        if sub not in subcommands:
            pytest.skip(f"`aenv {sub}` is not in this tree yet")
        help_text = run([aenv, sub, "--help"]).stdout
        for flag in re.findall(r"(--[a-z][a-z-]*)", exec_start):
            assert flag in help_text, f"{unit}.service passes {flag}, which `aenv {sub}` lacks"


def test_units_settings(inst: Install) -> None:
    node = unit_settings(inst.at("/etc/systemd/system/aenv.service").read_text())
    assert node["Service.ExecStart"] == [f"{inst.prefix}/bin/aenv serve $NODE_ARGS"]
    assert node["Service.Type"] == ["exec"]
    assert node["Service.KillMode"] == ["process"]  # sandboxes survive a restart
    assert node["Service.Delegate"] == ["yes"]
    assert node["Service.Restart"] == ["on-failure"]
    assert node["Service.LimitNOFILE"] == ["1048576"]
    assert "Service.User" not in node  # root: namespaces, cgroups, mounts
    assert node["Service.EnvironmentFile"] == ["-/etc/aenv/aenv.env"]
    assert node["Service.Environment"] == ["AENV_CONFIG=/etc/aenv/config.toml"]
    assert node["Service.ExecStartPost"][0].startswith(
        f"{inst.prefix}/lib/aenv/current/bin/python {inst.prefix}/lib/aenv/aenv-health --pid $MAINPID")
    for unit, sub, port in (("aenv-gateway", "gateway", "GATEWAY"), ("aenv-scheduler", "scheduler", "SCHEDULER")):
        s = unit_settings(inst.at(f"/etc/systemd/system/{unit}.service").read_text())
        assert s["Service.ExecStart"] == [
            f"{inst.prefix}/bin/aenv {sub} --etcd ${{ETCD_URL}} --listen ${{{port}_LISTEN}} ${port}_ARGS"]
        assert s["Service.User"] == ["aenv"] and s["Service.Group"] == ["aenv"]
        assert s["Service.Restart"] == ["on-failure"]
        assert s["Service.LimitNOFILE"] == ["1048576"]
        assert s["Service.NoNewPrivileges"] == ["yes"]
        assert any(f"--listen ${{{port}_LISTEN}}" in v for v in s["Service.ExecStartPost"])
        assert "Service.KillMode" not in s  # nothing of theirs outlives them


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(inst: Install, tmp_path: Path) -> None:
    for u in UNITS:
        path = inst.at(f"/etc/systemd/system/{u}.service")
        proc = run(["systemd-analyze", "verify", str(path)], check=False)
        assert proc.returncode == 0 and not proc.stderr.strip(), f"{u}.service:\n{proc.stderr}"
    # The check can fail: a bad value is reported (on stderr; verify still exits 0 for those).
    broken = tmp_path / "aenv.service"
    broken.write_text(inst.at("/etc/systemd/system/aenv.service").read_text()
                      .replace("KillMode=process", "KillMode=procces"))
    proc = run(["systemd-analyze", "verify", str(broken)], check=False)
    assert "kill mode" in proc.stderr.lower(), proc.stderr


# -- idempotence, local changes, upgrade ---------------------------------------------------------

def test_second_run_changes_nothing(inst: Install) -> None:
    before = snapshot(inst.root, inst.prefix)
    proc = inst.script()
    after = snapshot(inst.root, inst.prefix)
    assert before == after, {k: (before.get(k), after.get(k)) for k in before.keys() | after.keys()
                             if before.get(k) != after.get(k)}
    lines = report_lines(proc.stdout)
    assert lines and all(status.startswith("unchanged") for status, _ in lines), proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("install.sh: nothing changed")


def test_locally_changed_config_is_kept(inst: Install) -> None:
    conf = inst.at("/etc/aenv/config.toml")
    original = conf.read_text()
    conf.write_text(original + "# an operator's change\n")
    edited = conf.read_text()
    try:
        proc = inst.script()
        assert conf.read_text() == edited
        assert "locally changed" in proc.stdout
        dist = conf.with_name("config.toml.dist")
        assert dist.read_bytes() == (DEPLOY / "config.toml").read_bytes()
        assert stat.S_IMODE(dist.stat().st_mode) == 0o640
    finally:
        conf.write_text(original)
        conf.with_name("config.toml.dist").unlink(missing_ok=True)


@pytest.mark.slow  # a second virtualenv build (~20 s)
def test_upgrade_switches_venv_and_keeps_previous(inst: Install) -> None:
    lib = inst.prefix / "lib/aenv"
    old = os.readlink(lib / "current")
    marker = inst.tree / "src/aenv/_install_test_marker.py"
    marker.write_text("# changes the source hash: a new release\n")
    try:
        proc = inst.script()
        new = os.readlink(lib / "current")
        assert new != old and os.readlink(lib / "previous") == old, proc.stdout
        assert (lib / old).is_dir() and (lib / new / ".complete").exists()
        assert "serve" in run([str(inst.prefix / "bin/aenv"), "--help"]).stdout
        assert "install.sh: nothing changed" in inst.script().stdout
    finally:
        marker.unlink()


# -- uninstall, purge ----------------------------------------------------------------------------

def test_uninstall_removes_what_it_added_and_keeps_state(inst: Install) -> None:
    state_file = inst.at("/var/lib/aenv/aenv.sqlite3")
    state_file.write_text("a node's state\n")
    proc = inst.script("--uninstall")
    gone = [inst.prefix / "lib/aenv", inst.prefix / "bin/aenv",
            *(inst.at(f"/etc/systemd/system/{u}.service") for u in UNITS)]
    assert not [str(p) for p in gone if p.exists() or p.is_symlink()], proc.stdout
    kept = [state_file, inst.at("/etc/aenv/config.toml"), inst.at("/etc/aenv/aenv.env"),
            inst.at("/opt/aenv/runtime/py311/.complete")]
    assert all(p.exists() for p in kept), proc.stdout
    assert stat.S_IMODE(inst.at("/var/lib/aenv").stat().st_mode) == 0o700
    assert "aenv:" in inst.at("/etc/passwd").read_text()
    again = inst.script("--uninstall")
    assert "install.sh: nothing changed" in again.stdout


def test_purge_refuses_while_something_is_mounted_in_state(inst: Install) -> None:
    volume = inst.at("/var/lib/aenv/volume")
    volume.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(volume)], capture_output=True,
                      check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        proc = inst.script("--purge", check=False)
        assert proc.returncode != 0 and "mounted below" in proc.stderr
        assert inst.at("/var/lib/aenv/aenv.sqlite3").exists()
    finally:
        subprocess.run(["umount", str(volume)], check=True)
        volume.rmdir()


def test_purge_removes_state_config_and_user(inst: Install) -> None:
    proc = inst.script("--purge")
    for path in ("/etc/aenv", "/var/lib/aenv", "/opt/aenv"):
        assert not inst.at(path).exists(), f"{path} left:\n{proc.stdout}"
    assert "aenv:" not in inst.at("/etc/passwd").read_text()
    assert "aenv:" not in inst.at("/etc/group").read_text()
    assert not (inst.prefix / "lib/aenv").exists()
    assert "install.sh: nothing changed" in inst.script("--purge").stdout


# -- options -------------------------------------------------------------------------------------

def makefile_apt_packages() -> list[str]:
    line = next(x for x in (REPO / "Makefile").read_text().splitlines() if x.startswith("APT_PACKAGES"))
    return line.split(":=", 1)[1].split()


def test_apt_packages_are_the_makefiles() -> None:
    script = str(REPO / "scripts/install.sh")
    default = run(["bash", script, "--print-apt-packages"]).stdout.split()
    everything = run(["bash", script, "--print-apt-packages", "--with-test-packages",
                      "--with-etcd"]).stdout.split()
    own = ["python3.11", "python3.11-venv", "ca-certificates"]
    left_out = {"docker-registry", "skopeo", "apache2-utils",  # install.sh's APT_TEST_ONLY
                "etcd-server", "etcd-client"}  # APT_ETCD
    assert everything == makefile_apt_packages() + own
    assert default == [p for p in makefile_apt_packages() if p not in left_out] + own


def test_unknown_option_is_refused() -> None:
    proc = run(["bash", str(REPO / "scripts/install.sh"), "--frobnicate"], check=False)
    assert proc.returncode != 0 and "unknown option --frobnicate" in proc.stderr


def test_help_lists_every_option() -> None:
    text = run(["bash", str(REPO / "scripts/install.sh"), "--help"]).stdout
    parsed = set(re.findall(r"^\s+(--[a-z-]+)\)", (REPO / "scripts/install.sh").read_text(), re.MULTILINE))
    assert parsed, "no options found in the script"
    missing = [opt for opt in parsed if opt not in text]
    assert not missing, f"--help does not mention {missing}"
