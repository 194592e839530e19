"""deploy/bin/aenv-health: the readiness check of the systemd units and container images."""

from __future__ import annotations

import http.server
import importlib.machinery
import importlib.util
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from deploy_support import DEPLOY, run

SCRIPT = DEPLOY / "bin/aenv-health"


def load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("aenv_health", str(SCRIPT))
    spec = importlib.util.spec_from_loader("aenv_health", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


class Server:
    def __init__(self, status: int) -> None:
        outer = self
        self.status = status

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(outer.status if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server(204)
    yield srv
    srv.httpd.shutdown()


def health(*args: str) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, str(SCRIPT), *args], check=False, timeout=60)


def test_healthy_server(server: Server) -> None:
    assert health("--listen", f"0.0.0.0:{server.port}").returncode == 0  # 0.0.0.0: loopback
    assert health("--url", f"http://127.0.0.1:{server.port}/health").returncode == 0


def test_unhealthy_server(server: Server) -> None:
    server.status = 503
    proc = health("--listen", f"127.0.0.1:{server.port}", "--wait", "1.5", "--interval", "0.5")
    assert proc.returncode == 1 and "not healthy" in proc.stderr


def test_nothing_listening() -> None:
    srv = Server(204)
    port = srv.port
    srv.httpd.shutdown()
    srv.httpd.server_close()
    assert health("--listen", f"127.0.0.1:{port}").returncode == 1


def test_waits_for_a_server_process_by_pid(tmp_path: Path, server: Server) -> None:
    """`--pid`: the address comes from that `aenv <sub> --listen` process's command line."""
    fake = tmp_path / "aenv"  # argv[1] of the process is a path named `aenv`, as a console script's
    fake.write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(fake), "gateway", "--etcd", "http://e:2379",
                             "--listen", f"0.0.0.0:{server.port}"])
    try:
        assert health("--pid", str(proc.pid), "--wait", "10").returncode == 0
    finally:
        proc.kill()
        proc.wait()
    # That process gone: exit 2 at once rather than waiting out --wait.
    out = health("--pid", str(proc.pid), "--wait", "30")
    assert out.returncode == 2 and "exited" in out.stderr


def test_listen_parsing() -> None:
    mod = load_script()
    assert mod.url_for_listen("0.0.0.0:8080") == "http://127.0.0.1:8080/health"
    assert mod.url_for_listen("[::]:9090") == "http://[::1]:9090/health"
    assert mod.url_for_listen("10.0.0.5:8000") == "http://10.0.0.5:8000/health"
    argv = ["/opt/aenv/venv/bin/python", "/usr/local/bin/aenv", "scheduler", "--etcd", "x", "--listen=0.0.0.0:9090"]
    assert mod.listen_from_argv(argv) == "0.0.0.0:9090"
    assert mod.listen_from_argv(["/usr/bin/python3", "/srv/app.py", "serve"]) is None  # not aenv
    assert mod.listen_from_argv(["/usr/local/bin/aenv", "ls"]) is None  # not a server
