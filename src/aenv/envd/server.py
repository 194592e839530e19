"""envd's entry points and request routing.

Owns: `run()` (what a container runtime calls: serve forever on a socket), `preload()`
(what a fork server calls once so forked envds share their imported code), the `App`
that ties settings, users, the process supervisor and the services together, the
access-token gate, and the small endpoints: `GET /health`, `GET /envs`, `GET /metrics`,
`POST /init`.

`POST /init` updates the live settings (`accessToken`, `envVars`, `defaultUser`,
`defaultWorkdir`); a runtime uses it after forking a sandbox to give the child a fresh
token. It needs no `X-Access-Token` for first-time setup, but once a token is set the
caller must prove it knows it — in the `X-Access-Token` header or as the body's
`accessToken` — so code inside the sandbox cannot take envd over. A body without an
`accessToken` key leaves the token unchanged; `"accessToken": null` clears it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket

from aenv.envd.auth import UNAUTHORIZED, needs_token, tokens_equal
from aenv.envd.connect import Call, send_unary_error, serve
from aenv.envd.entries import Entries, MetadataStore
from aenv.envd.errors import RpcError
from aenv.envd.files import FilesApi
from aenv.envd.filesystem import FilesystemService
from aenv.envd.fscreds import FsCredentials
from aenv.envd.http import Connection, Request, Response
from aenv.envd.log import log
from aenv.envd.metrics import Metrics
from aenv.envd.process import Supervisor
from aenv.envd.process_service import ProcessService
from aenv.envd.settings import ENVD_VERSION, EnvdSettings
from aenv.envd.users import User, UserDb

RPC_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")


class App:
    def __init__(self, settings: EnvdSettings) -> None:
        self.settings = settings
        self.users = UserDb()
        self.supervisor = Supervisor(reap_all=settings.is_init)
        # File operations run with the requesting user's credentials (envd/fscreds.py).
        self.creds = FsCredentials()
        self.entries = Entries(self.users, MetadataStore(settings.metadata_dir, self.creds.as_envd))
        # Created now so the first /metrics reports CPU use since envd started.
        self.metrics = Metrics()
        self.process = ProcessService(self)
        self.filesystem = FilesystemService(self)
        self.files = FilesApi(self)
        self.methods = {**self.process.methods(), **self.filesystem.methods()}

    def user(self, username: str | None) -> User:
        """The user an operation runs as: the Basic-auth user, else the default user."""
        name = username if username is not None else self.settings.default_user
        if not name:
            raise RpcError("unauthenticated", "no user specified")
        return self.users.resolve(name)

    async def handle(self, request: Request, response: Response) -> None:
        method, path = request.method, request.path
        token = self.settings.access_token
        if token and needs_token(method, path) and not tokens_equal(request.header("x-access-token"), token):
            await response.send_error(401, UNAUTHORIZED)
            return

        rpc = self.methods.get(path)
        if rpc is not None:
            if method != "POST":
                await response.send_error(405, f"method {method} not allowed")
                return
            try:
                call = Call(request)
                if call.username is not None:
                    # Like envd's auth middleware: a named user must exist, for every RPC.
                    self.users.resolve(call.username)
            except RpcError as e:
                await send_unary_error(response, e)
                return
            await serve(rpc, call, response)
            return

        if path == "/health":
            if method in ("GET", "HEAD"):
                await response.send(204, headers=[("Cache-Control", "no-store")])
            else:
                await response.send_error(405, f"method {method} not allowed")
        elif path == "/files":
            await self.files.handle(request, response)
        elif path == "/envs" and method == "GET":
            await response.send_json(200, self.settings.env_vars, [("Cache-Control", "no-store")])
        elif path == "/metrics" and method == "GET":
            await response.send_json(200, self.metrics.snapshot(), [("Cache-Control", "no-store")])
        elif path == "/init" and method == "POST":
            await self.init(request, response)
        elif path.startswith(RPC_PREFIXES):
            await send_unary_error(response, RpcError("unimplemented", f"unknown procedure {path}", 404))
        else:
            await response.send_error(404, f"no route {method} {path}")

    async def init(self, request: Request, response: Response) -> None:
        headers = [("X-Envd-Version", ENVD_VERSION), ("Cache-Control", "no-store")]
        raw = await request.body.read_all(1 << 20)
        try:
            data = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the stack
            data = None
        if not isinstance(data, dict):
            await response.send_error(400, "failed to decode request")
            return
        settings = self.settings
        current = settings.access_token
        if current:
            header = request.header("x-access-token")
            offered = data.get("accessToken")
            if not (
                (header and tokens_equal(header, current))
                or (isinstance(offered, str) and offered and tokens_equal(offered, current))
            ):
                await response.send_error(401, "access token validation failed")
                return
        env_vars = data.get("envVars")
        if env_vars is not None and not (
            isinstance(env_vars, dict) and all(isinstance(v, str) for v in env_vars.values())
        ):
            await response.send_error(400, "envVars must be an object of strings")
            return
        if "accessToken" in data:
            token = data["accessToken"]
            settings.access_token = token if isinstance(token, str) and token else None
        if env_vars is not None:
            settings.env_vars = dict(env_vars)
        if isinstance(data.get("defaultUser"), str) and data["defaultUser"]:
            settings.default_user = data["defaultUser"]
        if isinstance(data.get("defaultWorkdir"), str) and data["defaultWorkdir"]:
            settings.default_workdir = data["defaultWorkdir"]
        await response.send(204, headers=headers)

    def close(self) -> None:
        self.filesystem.close()


def _ensure_std_fds() -> None:
    """Keep fds 0-2 open: a pipe landing on them would be clobbered in forked children."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


async def serve_forever(settings: EnvdSettings, listen_socket: socket.socket | None = None) -> None:
    """Serve until SIGTERM/SIGINT (both, for a PID 1 that the runtime asks to stop)."""
    loop = asyncio.get_running_loop()
    app = App(settings)
    app.supervisor.install(loop)
    sock = listen_socket if listen_socket is not None else _bind(settings.host, settings.port)
    server = await loop.create_server(lambda: Connection(app.handle), sock=sock, backlog=4096)
    stop: asyncio.Future[None] = loop.create_future()

    def request_stop() -> None:
        if not stop.done():
            stop.set_result(None)

    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, request_stop)
    address = sock.getsockname()
    log(f"listening on {address[0]}:{address[1]} (pid {os.getpid()})")
    try:
        await stop
    finally:
        server.close()
        app.close()
        app.supervisor.shutdown()
        log("stopped")


def run(settings: EnvdSettings, listen_socket: socket.socket | None = None) -> None:
    """Serve envd on `listen_socket` (or bind settings.host:settings.port) until stopped."""
    _ensure_std_fds()
    # Forked from a process that was inside a running loop (a fork server), Python 3.11
    # still believes that loop runs in this thread; the child has its own loop now.
    asyncio.events._set_running_loop(None)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serve_forever(settings, listen_socket))
    finally:
        loop.close()


def preload() -> None:
    """Import and warm up everything envd needs, then freeze the heap.

    A fork server calls this once and forks an envd per sandbox: modules imported here
    are shared copy-on-write by every child. `gc.freeze()` moves the objects created so
    far out of the collector's reach, so a child's garbage collections do not write to
    (and thereby un-share) the pages holding them.
    """
    import zlib

    from aenv.envd import fscreds, inotify
    from aenv.envd.auth import signature

    inotify.preload()
    fscreds.preload()
    signature("/", "read", "", "token", None)
    zlib.compressobj(1, zlib.DEFLATED, 31)
    json.dumps({"warm": [1]})
    gc.collect()
    gc.freeze()
