"""The /etc files that carry a sandbox's identity and network settings, as every runtime
writes them into a sandbox it starts or restores under a new name.

Owns: their contents. Must not touch: how a driver gets them into the sandbox (a write
through the sandbox's root, a control port into a VM guest).
"""

from __future__ import annotations

from pathlib import Path


def hosts(sandbox_id: str, address: str | None) -> str:
    """/etc/hosts: loopback names, and the sandbox's own name on its address (127.0.1.1 for a
    sandbox without one, as Debian does)."""
    return ("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{address or '127.0.1.1'}\t{sandbox_id}\n")


def host_resolv_conf(path: Path = Path("/etc/resolv.conf")) -> str | None:
    """The host's resolvers, for sandboxes with internet access, or None if it has none a
    sandbox could use. Loopback resolvers (a local stub like systemd-resolved) are
    unreachable from a sandbox, so they are dropped; malformed lines are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    out: list[str] = []
    for line in lines:
        words = line.split()
        if len(words) < 2 or words[0] not in ("nameserver", "search", "options"):
            continue
        if words[0] == "nameserver" and words[1].startswith(("127.", "::1")):
            continue
        out.append(line)
    if not any(line.startswith("nameserver") for line in out):
        return None
    return "\n".join(out) + "\n"
