"""The /etc files runtimes write into sandboxes (`aenv.runtime.etc_files`)."""

from __future__ import annotations

from pathlib import Path

from aenv.runtime.etc_files import host_resolv_conf, hosts


def test_resolv_conf_keeps_usable_resolvers_only(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# comment\nnameserver\nnameserver 127.0.0.53\nnameserver ::1\n"
                    "nameserver 10.0.0.2\nsearch example.org\noptions edns0\ndomain x\n")
    assert host_resolv_conf(conf) == (
        "nameserver 10.0.0.2\nsearch example.org\noptions edns0\n")


def test_resolv_conf_with_only_a_local_stub_is_none(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("nameserver 127.0.0.53\nsearch lan\n")
    assert host_resolv_conf(conf) is None
    assert host_resolv_conf(tmp_path / "missing") is None


def test_hosts_names_the_sandbox() -> None:
    assert hosts("abc", "10.88.0.5").splitlines()[-1] == "10.88.0.5\tabc"
    assert hosts("abc", None).splitlines()[-1] == "127.0.1.1\tabc"
