"""Egress policies (E2B's `network.allowOut` / `denyOut`, `PUT /sandboxes/{id}/network`) and
public-traffic tokens (`allowPublicTraffic: false`), through the official SDK against the
session's server.

Every destination is a test host in a network namespace this module makes (tests/net_helpers:
198.18.0.0/15, reached through the host's masquerade like the internet): TCP services, an HTTP
server on port 80 that echoes the Host it was asked for, and a TLS server on 443 (a self-signed
certificate made here with openssl) that echoes the SNI. Domain rules are checked by asking
these hosts by IP with a Host header / SNI, so nothing depends on DNS. A refused connection
must fail at once (reset / ICMP), not hang.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox
from e2e_helpers import assert_json_error, container_only, wait_until
from net_helpers import OutsideHost, in_netns, outside_host, tcp_listener, tcp_service

from aenv.devserver import ServerProcess

pytestmark = container_only
HOST = "10.88.0.1"  # the bridge address: the host itself, refused to sandboxes
FAST_S = 2.0  # a refusal is a reset or an ICMP error: well under this

PROBE = """
import socket, sys, time
t = time.monotonic()
s = socket.socket(); s.settimeout(8)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("ok", s.recv(16).decode().strip(), round(time.monotonic() - t, 3))
except OSError as e:
    print("refused", type(e).__name__, round(time.monotonic() - t, 3))
"""


@dataclass
class WebHost:
    """An outside host with a TCP `hello` service, HTTP on 80 and TLS on 443."""

    host: OutsideHost
    tcp_port: int
    label: str
    sni_seen: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.host.address


def _answer(conn: socket.socket, label: str, extra: str) -> None:
    head = b""
    conn.settimeout(5)
    with contextlib.suppress(OSError):
        while b"\r\n\r\n" not in head and len(head) < 16384:
            chunk = conn.recv(4096)
            if not chunk:
                return
            head += chunk
        host = next((line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                     if line.lower().startswith(b"host:")), "")
        body = f"{label} host={host}{extra}".encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%b"
                     % (len(body), body))


def _serve(listener: socket.socket, handle: object) -> None:
    listener.settimeout(0.2)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        threading.Thread(target=handle, args=(conn,), daemon=True).start()  # type: ignore[arg-type]


@contextlib.contextmanager
def web_host(label: str) -> Iterator[WebHost]:
    with outside_host() as host, tempfile.TemporaryDirectory() as tmp:
        key, cert = Path(tmp) / "key.pem", Path(tmp) / "cert.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=egress.test", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        seen: list[str] = []

        def on_sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
            seen.append(name or "")

        ctx.sni_callback = on_sni

        def plain(conn: socket.socket) -> None:
            with conn:
                _answer(conn, label, "")

        def tls(conn: socket.socket) -> None:
            with conn, contextlib.suppress(OSError):
                conn.settimeout(5)
                with ctx.wrap_socket(conn, server_side=True) as wrapped:
                    _answer(wrapped, label, f" sni={seen[-1] if seen else ''}")

        listeners = [in_netns(host.netns, lambda p=p: _bound(p)) for p in (80, 443)]
        for listener, handler in zip(listeners, (plain, tls), strict=True):
            threading.Thread(target=_serve, args=(listener, handler), daemon=True).start()
        try:
            with tcp_service(lambda: in_netns(host.netns, tcp_listener)) as svc:
                yield WebHost(host, svc.port, label, seen)
        finally:
            for listener in listeners:
                listener.close()


def _bound(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", port))
    sock.listen(16)
    return sock


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[WebHost, WebHost]]:
    with web_host("A") as a, web_host("B") as b:
        yield a, b


def _sandbox(**opts: object) -> Sandbox:
    sbx = Sandbox.create(timeout=300, metadata={"suite": "egress"}, **opts)  # type: ignore[arg-type]
    sbx.files.write("/tmp/probe.py", PROBE)
    return sbx


def tcp(sbx: Sandbox, address: str, port: int) -> tuple[bool, float]:
    out = sbx.commands.run(f"python3 /tmp/probe.py {address} {port}", timeout=30).stdout.split()
    return out[0] == "ok", float(out[-1])


def curl(sbx: Sandbox, args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        r = sbx.commands.run(f"curl -sS -m 8 {args}", timeout=30)
        return 0, str(r.stdout), time.monotonic() - t0
    except CommandExitException as exc:
        return exc.exit_code, exc.stderr, time.monotonic() - t0


def reachable(sbx: Sandbox, host: WebHost) -> bool:
    ok, seconds = tcp(sbx, host.address, host.tcp_port)
    if not ok:
        assert seconds < FAST_S, f"refusal of {host.address} took {seconds:.2f} s"
    return ok


def test_cidr_allow_wins_and_the_rest_is_refused_fast(hosts: tuple[WebHost, WebHost]) -> None:
    a, b = hosts
    sbx = _sandbox(network={"allow_out": [f"{a.address}/32"], "deny_out": ["0.0.0.0/0"]})
    try:
        assert reachable(sbx, a)  # allowed although 0.0.0.0/0 is denied: allow wins
        assert not reachable(sbx, b)
        # UDP is refused too, with an ICMP error rather than silence.
        code = ("import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
                f"s.settimeout(3); s.connect(({b.address!r}, 9)); s.send(b'x')\n"
                "try:\n s.recv(1); print('answered')\n"
                "except TimeoutError: print('silent')\n"
                "except OSError as e: print('refused', e.errno)")
        sbx.files.write("/tmp/udp.py", code)
        assert sbx.commands.run("python3 /tmp/udp.py", timeout=30).stdout.startswith("refused")
    finally:
        sbx.kill()


def test_deny_only_leaves_the_rest_open(hosts: tuple[WebHost, WebHost]) -> None:
    a, b = hosts
    sbx = _sandbox(network={"deny_out": [b.address]})
    try:
        assert reachable(sbx, a) and not reachable(sbx, b)
    finally:
        sbx.kill()


def test_live_change_and_kept_across_pause_and_fork(hosts: tuple[WebHost, WebHost],
                                                   api: httpx.Client) -> None:
    a, b = hosts
    sbx = _sandbox(network={"allow_out": [a.address], "deny_out": ["0.0.0.0/0"]})
    children: list[Sandbox] = []
    try:
        assert reachable(sbx, a) and not reachable(sbx, b)
        t0 = time.monotonic()
        sbx.update_network({"allow_out": [b.address], "deny_out": ["0.0.0.0/0"]})
        change_s = time.monotonic() - t0
        assert not reachable(sbx, a) and reachable(sbx, b), "the change is live"
        assert change_s < 1.0, change_s
        detail = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert detail["network"]["allowOut"] == [b.address]
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id)  # a new network slot, the same rules
        sbx.files.write("/tmp/probe.py", PROBE)
        assert not reachable(sbx, a) and reachable(sbx, b)
        # A paused sandbox's rules change on record and hold at its resume.
        sbx.pause()
        sbx.update_network({"allow_out": [a.address], "deny_out": ["0.0.0.0/0"]})
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert reachable(sbx, a) and not reachable(sbx, b)
        children = [c for c in sbx.fork(count=2) if isinstance(c, Sandbox)]
        assert len(children) == 2
        for child in children:  # inherited
            assert reachable(child, a) and not reachable(child, b)
        children[0].update_network({})  # all rules cleared: everything allowed
        assert reachable(children[0], b)
        assert not reachable(children[1], b) and not reachable(sbx, b)  # the others keep theirs
    finally:
        for child in children:
            child.kill()
        sbx.kill()


def test_domain_rules_by_host_header_and_sni(hosts: tuple[WebHost, WebHost]) -> None:
    a, b = hosts
    sbx = _sandbox(network={"allow_out": ["allowed.test", "*.wild.test"],
                            "deny_out": ["0.0.0.0/0"]})
    try:
        code, out, _ = curl(sbx, f"-H 'Host: allowed.test' http://{a.address}/")
        assert (code, out) == (0, "A host=allowed.test"), out
        code, out, _ = curl(sbx, f"-H 'Host: x.y.wild.test:80' http://{b.address}/")
        assert (code, out) == (0, "B host=x.y.wild.test:80"), out  # the name decides, not the IP
        for host in ("other.test", "wild.test", "allowed.test.evil"):
            code, out, seconds = curl(sbx, f"-H 'Host: {host}' http://{a.address}/")
            assert code != 0 and seconds < FAST_S, (host, code, out, seconds)
        code, out, _ = curl(sbx, f"-k --resolve allowed.test:443:{a.address} "
                                 "https://allowed.test/")
        assert (code, out) == (0, "A host=allowed.test sni=allowed.test"), out
        code, out, _ = curl(sbx, f"-k --resolve a.wild.test:443:{b.address} https://a.wild.test/")
        assert code == 0 and out.endswith("sni=a.wild.test"), out
        before = len(a.sni_seen)
        code, out, seconds = curl(sbx, f"-k --resolve evil.test:443:{a.address} "
                                       "https://evil.test/")
        assert code != 0 and seconds < FAST_S, (code, out, seconds)
        assert len(a.sni_seen) == before, "a refused ClientHello never reaches the host"
        # Domain rules are for HTTP and TLS only: other ports stay refused by address.
        assert not reachable(sbx, a)
        # The host's own addresses stay refused, whatever the Host header says.
        code, out, seconds = curl(sbx, f"-H 'Host: allowed.test' http://{HOST}/")
        assert code != 0 and seconds < FAST_S, (code, out)
        code, out, seconds = curl(sbx, f"-H 'Host: allowed.test' http://{a.host.host_address}/")
        assert code != 0 and seconds < FAST_S, (code, out)
    finally:
        sbx.kill()


def test_bad_rules_and_unsupported_fields_refused(api: httpx.Client) -> None:
    base = {"templateID": "base", "timeout": 60}
    for network, status in (({"allowOut": ["not a host!"]}, 400),
                            ({"denyOut": ["example.com"]}, 400),
                            ({"denyOut": ["10.0.0.0/33"]}, 400),
                            ({"dnsServers": ["dns.google"]}, 400),
                            ({"egressProxy": {"address": "proxy:1080"}}, 501)):
        assert_json_error(api.post("/sandboxes", json={**base, "network": network}), status)


def test_no_internet_access_stays_deny_all(hosts: tuple[WebHost, WebHost],
                                           api: httpx.Client) -> None:
    a, _ = hosts
    sbx = _sandbox(allow_internet_access=False)
    try:
        assert not reachable(sbx, a)
        assert_json_error(api.put(f"/sandboxes/{sbx.sandbox_id}/network",
                                  json={"allowOut": [a.address]}), 409)
    finally:
        sbx.kill()
    # With an allow list it is denyOut 0.0.0.0/0 plus the allowed destinations.
    sbx = _sandbox(allow_internet_access=False, network={"allow_out": [a.address]})
    try:
        assert reachable(sbx, a)
        _, b = hosts
        assert not reachable(sbx, b)
        snap = sbx.create_snapshot()
        inherited = Sandbox.create(snap.snapshot_id, timeout=60)  # the snapshot's own rules
        try:
            assert reachable(inherited, a) and not reachable(inherited, b)
        finally:
            inherited.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        sbx.kill()
    # A snapshot of a sandbox with a network interface keeps it (its image needs it): a copy
    # asked for without internet access is denied everything on it instead.
    plain = _sandbox()
    try:
        snap = plain.create_snapshot()
        copy = Sandbox.create(snap.snapshot_id, allow_internet_access=False, timeout=60)
        try:
            assert not reachable(copy, a)
        finally:
            copy.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)
    finally:
        plain.kill()


ECHO_SERVER = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"host": self.headers.get("Host"),
                           "token": self.headers.get("e2b-traffic-access-token")}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
import json
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def _upgrade_status(server: ServerProcess, sandbox_id: str, token: str | None) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(("GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
                   f"E2b-Sandbox-Id: {sandbox_id}\r\nE2b-Sandbox-Port: 8080\r\n"
                   + (f"e2b-traffic-access-token: {token}\r\n" if token else "")
                   + "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     "\r\n").encode())
        return s.recv(64).split(b"\r\n")[0]


def test_public_traffic_token(server: ServerProcess) -> None:
    mask = "${PORT}-masked.example"
    sbx = Sandbox.create(timeout=120, network={"allow_public_traffic": False,
                                               "mask_request_host": mask})
    try:
        token = sbx.traffic_access_token
        assert token
        sbx.files.write("/tmp/echo.py", ECHO_SERVER)
        sbx.commands.run("python3 /tmp/echo.py", background=True)
        url = f"{server.url}/"
        route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8080"}
        wait_until(lambda: httpx.get(url, headers={**route, "e2b-traffic-access-token": token}
                                     ).status_code == 200, 20, what="the echo server")
        resp = httpx.get(url, headers=route)
        assert_json_error(resp, 403)
        assert_json_error(httpx.get(url, headers={**route, "e2b-traffic-access-token": "x"}), 403)
        resp = httpx.get(url, headers={**route, "e2b-traffic-access-token": token})
        # The sandbox sees the masked host and never the token itself.
        assert resp.json() == {"host": "8080-masked.example", "token": None}
        assert _upgrade_status(server, sbx.sandbox_id, None).startswith(b"HTTP/1.1 403")
        assert not _upgrade_status(server, sbx.sandbox_id, token).startswith(b"HTTP/1.1 403")
        # envd needs no traffic token (the SDK works as ever), and connect returns it again.
        assert sbx.commands.run("echo hi").stdout == "hi\n"
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.traffic_access_token == token
    finally:
        sbx.kill()
    plain = Sandbox.create(timeout=60)
    try:
        assert plain.traffic_access_token is None
    finally:
        plain.kill()


def test_rules_on_record(api: httpx.Client) -> None:
    """The rules are on the sandbox's record, as accepted: what GET returns."""
    sbx = Sandbox.create(timeout=60, network={"allow_out": ["1.2.3.4"], "deny_out": ["0.0.0.0/0"],
                                              "dns_servers": ["9.9.9.9"]})
    try:
        net = api.get(f"/sandboxes/{sbx.sandbox_id}").json()["network"]
        assert net == {"allowOut": ["1.2.3.4"], "denyOut": ["0.0.0.0/0"],
                       "dnsServers": ["9.9.9.9"]}, json.dumps(net)
    finally:
        sbx.kill()


def test_rules_and_volumes_survive_a_server_restart(hosts: tuple[WebHost, WebHost]) -> None:
    """Rules live in the record and the runtime handle: a restarted server re-installs them
    (its domain proxy listens on a new port, the DNAT rules follow) and keeps its volumes."""
    from e2b import Volume

    from aenv.devserver import prepare_home, remove_home

    a, b = hosts
    home = prepare_home("aenv-e2e-egress-")
    srv = ServerProcess(home=home, api_key="egress-key").start(ready_timeout=300)
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    try:
        vol = Volume.create("restart-vol", **opts)  # type: ignore[arg-type]
        sbx = Sandbox.create(timeout=300, network={"allow_out": [a.address, "allowed.test"],
                                                   "deny_out": ["0.0.0.0/0"]},
                             volume_mounts={"/data": vol}, **opts)  # type: ignore[arg-type]
        sbx.files.write("/tmp/probe.py", PROBE)
        sbx.commands.run("echo kept > /data/f", user="root")
        srv.stop()
        srv = ServerProcess(home=home, port=srv.port, api_key=srv.api_key).start(
            ready_timeout=300)
        assert reachable(sbx, a) and not reachable(sbx, b)
        code, out, _ = curl(sbx, f"-H 'Host: allowed.test' http://{b.address}/")
        assert (code, out) == (0, "B host=allowed.test"), out  # through the new proxy
        code, _, seconds = curl(sbx, f"-H 'Host: other.test' http://{b.address}/")
        assert code != 0 and seconds < FAST_S
        vol = Volume.connect(vol.volume_id, **opts)  # type: ignore[arg-type]
        assert vol.read_file("/f", api_url=srv.url) == "kept\n"
        sbx.kill()
        Volume.destroy(vol.volume_id, **opts)  # type: ignore[arg-type]
    finally:
        srv.shutdown()
        remove_home(home)
