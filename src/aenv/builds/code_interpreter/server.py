"""E2B's code-interpreter protocol on port 49999, served inside a `code-interpreter-v1` sandbox.

Owns: the HTTP API the `e2b-code-interpreter` SDKs speak (`GET /health`, `POST /execute`
streaming one JSON object a line: stdout / stderr / result / error / number_of_executions,
then `end_of_execution`; `GET|POST /contexts`, `DELETE /contexts/{id}`,
`POST /contexts/{id}/restart`) and one Jupyter kernel per context, driven directly through
`jupyter_client` (no Jupyter Server, no websocket hop). Wire shapes follow E2B's
`template/server` (FastAPI + websocket to Jupyter Server), which this replaces.

Runs on the template's own Python (a venv with ipykernel, jupyter_client and tornado, which
both ship with), never on the host: it is not imported by aenv itself, and it must not import
aenv. Kernels talk ZeroMQ over unix sockets (`ipc`), not TCP: the sandbox is checkpointed by
CRIU with `--tcp-close`, which would cut TCP connections between this server and its
kernels at every pause, snapshot and fork; unix socket pairs are restored intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import tornado.httpclient
import tornado.iostream
import tornado.web
from jupyter_client.manager import AsyncKernelManager

PORT = 49999
ENVD_URL = "http://127.0.0.1:49983"
DEFAULT_CWD = "/home/user"
RUNTIME_DIR = os.path.join(os.path.expanduser("~"), ".aenv-code-interpreter")
KERNEL_START_TIMEOUT_S = 120.0
# Kernel names by the SDKs' language names; a language is offered when its kernel is installed.
KERNEL_NAMES = {"python": "python3", "bash": "bash"}
LANGUAGE_ALIASES = {"js": "javascript", "ts": "typescript", "py": "python", "sh": "bash"}
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Refused(tornado.web.HTTPError):
    """A request answered with `status` and `message` as its plain-text body."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status)
        self.message = message


def normalize_language(language: str | None) -> str:
    name = (language or "python").strip().lower()
    return LANGUAGE_ALIASES.get(name, name)


def result_body(data: dict[str, Any], is_main_result: bool) -> dict[str, Any]:
    """A display_data / execute_result bundle as E2B's `Result` (api/models/result.py)."""
    data = dict(data)
    text = data.pop("text/plain", None)
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]  # E2B strips the quotes of a str's repr
    body: dict[str, Any] = {"type": "result", "text": text, "html": data.pop("text/html", None),
                            "markdown": data.pop("text/markdown", None),
                            "svg": data.pop("image/svg+xml", None),
                            "png": data.pop("image/png", None),
                            "jpeg": data.pop("image/jpeg", None),
                            "pdf": data.pop("application/pdf", None),
                            "latex": data.pop("text/latex", None),
                            "json": data.pop("application/json", None),
                            "javascript": data.pop("application/javascript", None),
                            "data": data.pop("e2b/data", None),
                            "chart": data.pop("e2b/chart", None)}
    body = {k: v for k, v in body.items() if v is not None}
    body["extra"] = data
    body["is_main_result"] = is_main_result
    return body


def _timestamp(header: dict[str, Any]) -> str:
    date = header.get("date")
    if isinstance(date, datetime.datetime):
        return date.isoformat()
    return str(date or datetime.datetime.now(datetime.UTC).isoformat())


@dataclass
class Execution:
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    errored: bool = False


class Context:
    """One kernel and the executions in flight on it (one at a time, as E2B's server)."""

    def __init__(self, context_id: str, language: str, kernel_name: str, cwd: str) -> None:
        self.id = context_id
        self.language = language
        self.cwd = cwd
        self.manager = AsyncKernelManager(kernel_name=kernel_name, transport="ipc")
        self.manager.connection_file = os.path.join(RUNTIME_DIR, f"k-{context_id[:8]}.json")
        # ipc endpoints are files named after `ip`; keep them short (sun_path: 108 bytes).
        self.manager.ip = os.path.join(RUNTIME_DIR, context_id[:8])
        self.client: Any = None
        self.lock = asyncio.Lock()
        self.executions: dict[str, Execution] = {}
        self.global_envs: dict[str, str] | None = None
        self._reader: asyncio.Task[None] | None = None

    def body(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        env = dict(os.environ)
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        # Plain tracebacks: the SDKs show `traceback` as text, not as a terminal would.
        await self.manager.start_kernel(cwd=self.cwd if os.path.isdir(self.cwd) else None,
                                        env=env, extra_arguments=["--colors=NoColor"])
        await self._connect()
        error = await self.run_silently(self._cd_code(self.cwd))
        if error is not None:
            await self.close()
            raise Refused(400, f"cannot use {self.cwd!r} as the working directory: "
                          f"{error.get('value')}")

    async def _connect(self) -> None:
        self.client = self.manager.client()
        self.client.start_channels()
        await self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT_S)
        self._reader = asyncio.create_task(self._read_iopub())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._end_all({"type": "error", "name": "ContextClosed", "value": "the context was removed",
                       "traceback": ""})
        if self.client is not None:
            self.client.stop_channels()
        await self.manager.shutdown_kernel(now=True)
        with contextlib.suppress(OSError):
            os.unlink(self.manager.connection_file)

    async def restart(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._end_all({"type": "error", "name": "ContextRestarting",
                       "value": "Context was restarted", "traceback": ""})
        self.client.stop_channels()
        await self.manager.restart_kernel(now=True)
        self.global_envs = None
        await self._connect()
        await self.run_silently(self._cd_code(self.cwd))

    def _end_all(self, error: dict[str, Any]) -> None:
        for execution in self.executions.values():
            execution.queue.put_nowait(error)
            execution.queue.put_nowait(None)
        self.executions.clear()

    def _cd_code(self, path: str) -> str:
        if self.language == "python":
            return f"import os as __os; __os.chdir({path!r}); del __os"
        return f"cd {_sh_quote(path)}"

    def _env_code(self, envs: dict[str, str], unset: list[str]) -> str:
        if self.language == "python":
            lines = [f"__import__('os').environ[{k!r}] = {v!r}" for k, v in envs.items()]
            lines += [f"__import__('os').environ.pop({k!r}, None)" for k in unset]
        else:
            lines = [f"export {k}={_sh_quote(v)}" for k, v in envs.items()]
            lines += [f"unset {k}" for k in unset]
        return "\n".join(lines)

    async def _read_iopub(self) -> None:
        while True:
            msg = await self.client.get_iopub_msg()
            parent = msg.get("parent_header", {}).get("msg_id")
            execution = self.executions.get(parent) if parent else None
            if execution is None:
                continue
            kind, content = msg["msg_type"], msg["content"]
            out: dict[str, Any] | None = None
            if kind == "stream":
                out = {"type": content["name"], "text": content["text"],
                       "timestamp": _timestamp(msg["header"])}
            elif kind in ("execute_result", "display_data"):
                out = result_body(content["data"], kind == "execute_result")
            elif kind == "error":
                if not execution.errored:
                    execution.errored = True
                    out = {"type": "error", "name": content["ename"], "value": content["evalue"],
                           "traceback": "\n".join(content["traceback"])}
            elif kind == "execute_input":
                out = {"type": "number_of_executions",
                       "execution_count": content["execution_count"]}
            elif kind == "status" and content["execution_state"] == "idle":
                # idle on iopub after our request: every output of it has been published
                self.executions.pop(parent, None)
                execution.queue.put_nowait(None)
            if out is not None:
                execution.queue.put_nowait(out)

    def _submit(self, code: str, silent: bool) -> Execution:
        execution = Execution()
        msg_id = self.client.execute(code, silent=silent, store_history=not silent,
                                     allow_stdin=False, stop_on_error=True)
        self.executions[msg_id] = execution
        return execution

    async def run_silently(self, code: str) -> dict[str, Any] | None:
        """Run code of ours (cwd, env vars) without output or history; its error, if any."""
        if not code:
            return None
        execution = self._submit(code, True)
        error = None
        while (item := await execution.queue.get()) is not None:
            if item["type"] == "error" and error is None:
                error = item
        return error

    async def execute(self, code: str, envs: dict[str, str] | None,
                      access_token: str | None) -> AsyncIterator[dict[str, Any]]:
        """The outputs of one cell, as the wire's JSON objects (end_of_execution excluded)."""
        async with self.lock:
            if self.global_envs is None:
                # The sandbox's env vars, read from envd at the first execution (a kernel of
                # the template started before this sandbox and its envs existed).
                self.global_envs = await _sandbox_envs(access_token)
                await self.run_silently(self._env_code(self.global_envs, []))
            if envs:
                await self.run_silently(self._env_code(envs, []))
            execution = self._submit(code, False)
            try:
                while (item := await execution.queue.get()) is not None:
                    yield item
            finally:
                if envs:
                    restore = {k: self.global_envs[k] for k in envs if k in self.global_envs}
                    await self.run_silently(self._env_code(
                        restore, [k for k in envs if k not in self.global_envs]))


def _sh_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


async def _sandbox_envs(access_token: str | None) -> dict[str, str]:
    headers = {"X-Access-Token": access_token} if access_token else {}
    try:
        response = await tornado.httpclient.AsyncHTTPClient().fetch(
            f"{ENVD_URL}/envs", headers=headers, request_timeout=5)
        envs = json.loads(response.body)
    except (OSError, ValueError, tornado.httpclient.HTTPClientError) as exc:
        # envd unreachable or odd: run the cell without them rather than fail it
        print(f"code-interpreter: cannot read the sandbox's env vars: {exc}", file=sys.stderr)
        return {}
    if not isinstance(envs, dict):
        return {}
    return {k: v for k, v in envs.items() if isinstance(v, str) and _ENV_KEY.match(k)}


class Contexts:
    def __init__(self, kernels: dict[str, str]) -> None:
        self.kernels = kernels  # language -> kernel name, the installed ones
        self.by_id: dict[str, Context] = {}
        self.default: dict[str, str] = {}  # language -> its default context id
        self._default_lock = asyncio.Lock()

    async def create(self, language: str, cwd: str) -> Context:
        if language not in self.kernels:
            raise Refused(400, f"language {language!r} is not supported "
                          f"(available: {', '.join(sorted(self.kernels))})")
        ctx = Context(str(uuid.uuid4()), language, self.kernels[language], cwd)
        await ctx.start()
        self.by_id[ctx.id] = ctx
        return ctx

    async def default_for(self, language: str) -> Context:
        async with self._default_lock:
            ctx_id = self.default.get(language)
            if ctx_id is None or ctx_id not in self.by_id:
                ctx = await self.create(language, DEFAULT_CWD)
                self.default[language] = ctx.id
                return ctx
            return self.by_id[ctx_id]


class Handler(tornado.web.RequestHandler):
    contexts: Contexts

    def initialize(self, contexts: Contexts) -> None:
        self.contexts = contexts

    def json_body(self) -> dict[str, Any]:
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            raise Refused(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        return body

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        # The message goes in the body, as E2B's server answers (PlainTextResponse); the
        # status line keeps its standard reason phrase.
        exc = kwargs.get("exc_info", (None, None, None))[1]
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(exc.message if isinstance(exc, Refused) else self._reason)

    def context(self, context_id: str) -> Context:
        ctx = self.contexts.by_id.get(context_id)
        if ctx is None:
            raise Refused(404, f"Context {context_id} not found")
        return ctx


class HealthHandler(Handler):
    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish('"OK"')


class ExecuteHandler(Handler):
    async def post(self) -> None:
        body = self.json_body()
        code, context_id, language = body.get("code"), body.get("context_id"), body.get("language")
        if not isinstance(code, str):
            raise Refused(400, "code must be a string")
        if context_id and language:
            raise Refused(400, "Only one of context_id or language can be provided")
        envs = body.get("env_vars") or None
        if envs is not None and not (isinstance(envs, dict) and all(
                isinstance(k, str) and _ENV_KEY.match(k) and isinstance(v, str)
                for k, v in envs.items())):
            raise Refused(400, "env_vars must map variable names to strings")
        if context_id:
            ctx = self.context(str(context_id))
        else:
            ctx = await self.contexts.default_for(normalize_language(language))
        self.set_header("Content-Type", "application/x-ndjson")
        gone = False
        async for item in ctx.execute(code, envs, self.request.headers.get("X-Access-Token")):
            # Set on the first output (execute_input), not before: while this request waits
            # for the context's lock, the cell running is someone else's.
            self._running = ctx
            if gone:
                continue  # drain: the interrupted cell still ends with its error and idle
            try:
                self.write(json.dumps(item) + "\n")
                await self.flush()
            except tornado.iostream.StreamClosedError:
                gone = True
        self._running = None
        if not gone:
            self.finish('{"type": "end_of_execution"}\n')

    _running: Context | None = None

    def on_connection_close(self) -> None:
        # The client went away mid-cell (timeout, cancelled request): interrupt the kernel so
        # the context's next execution is not stuck behind this one, as E2B's server does.
        ctx = self._running
        if ctx is not None:
            asyncio.ensure_future(ctx.manager.interrupt_kernel())


class ContextsHandler(Handler):
    async def post(self) -> None:
        body = self.json_body()
        cwd = body.get("cwd") or DEFAULT_CWD
        if not isinstance(cwd, str):
            raise Refused(400, "cwd must be a string")
        ctx = await self.contexts.create(normalize_language(body.get("language")), cwd)
        self.finish(ctx.body())

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps([c.body() for c in self.contexts.by_id.values()]))


class ContextHandler(Handler):
    async def delete(self, context_id: str) -> None:
        ctx = self.context(context_id)
        del self.contexts.by_id[context_id]
        await ctx.close()
        self.finish()


class RestartHandler(Handler):
    async def post(self, context_id: str) -> None:
        await self.context(context_id).restart()
        self.finish()


async def main() -> None:
    os.makedirs(RUNTIME_DIR, mode=0o700, exist_ok=True)
    from jupyter_client.kernelspec import KernelSpecManager

    installed = KernelSpecManager().find_kernel_specs()
    contexts = Contexts({lang: name for lang, name in KERNEL_NAMES.items() if name in installed})
    # The default Python kernel starts before the port answers: a template snapshot is taken
    # once /health answers, so every sandbox from it starts with a warm kernel.
    await contexts.default_for("python")
    args = {"contexts": contexts}
    app = tornado.web.Application([
        (r"/health", HealthHandler, args),
        (r"/execute", ExecuteHandler, args),
        (r"/contexts", ContextsHandler, args),
        (r"/contexts/([^/]+)/restart", RestartHandler, args),
        (r"/contexts/([^/]+)", ContextHandler, args),
    ])
    app.listen(PORT, address="0.0.0.0", idle_connection_timeout=640)
    print(f"code-interpreter: serving on :{PORT}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
