"""Entry point of the `aenv` command."""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aenv.cli.build import cmd_build, cmd_template_watch
from aenv.cli.client import ApiError, Client, save_credentials
from aenv.cli.files import cmd_connect, cmd_download, cmd_upload
from aenv.cli.output import each_target, emit
from aenv.cli.pull import cmd_cache, cmd_pull, cmd_template

SANDBOX_COLUMNS = ("sandboxID", "templateID", "state", "startedAt", "endAt", "cpuCount",
                   "memoryMB")


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from aenv.api.app import build_server
    from aenv.api.upgrade import TunnelingHttpToolsProtocol
    from aenv.config import load_config
    from aenv.errors import AenvError

    if os.geteuid() != 0:
        print("aenv: `aenv serve` needs root (it creates namespaces, cgroups and overlay mounts)",
              file=sys.stderr)
        return 2
    env = dict(os.environ)
    if args.home:
        env["AENV_HOME"] = args.home
    try:
        config = load_config(env, Path(args.config) if args.config else None)
    except AenvError as exc:
        print(f"aenv: {exc.message}", file=sys.stderr)
        return 2
    if args.listen:
        config.server.listen = args.listen
    host, _, port = config.server.listen.rpartition(":")
    if not host or not port.isdigit():
        print(f"aenv: --listen must be HOST:PORT, got {config.server.listen!r}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A fixed umask, not the operator's: what the server writes into layers and workspaces
    # is what sandboxes see (a 077 umask would make their directories unreadable to their
    # users). Privacy on the host comes from the home being 0700 (storage/layout.py) and
    # the secrets, database and checkpoint images' own modes.
    os.umask(0o022)
    try:
        server = build_server(config)
    except AenvError as exc:
        print(f"aenv: {exc.message}", file=sys.stderr)
        return 2
    print(f"aenv: serving on http://{config.server.listen} (home {config.home})", file=sys.stderr)
    print(f"aenv: API key: {server.api_key}", file=sys.stderr)
    app = server.app
    if args.cluster:  # a cluster node: the agent registers it and keeps its roster in etcd
        from aenv.cluster.agent import attach

        try:
            app = attach(app, server.manager, server.api_key, args.cluster,
                         args.advertise, config.server.listen, args.node_id)
        except AenvError as exc:
            print(f"aenv: {exc.message}", file=sys.stderr)
            return 2
    # http: uvicorn's httptools protocol that tunnels upgrades to sandbox ports (WebSocket
    # included, so no WebSocket implementation of uvicorn's own); no `server: uvicorn`
    # header, which proxied answers would carry next to the sandbox server's own.
    uvicorn.run(app, host=host, port=int(port), loop="uvloop",
                http=TunnelingHttpToolsProtocol, ws="none", server_header=False,
                log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    return 0


def cmd_auth(args: argparse.Namespace, client: Client) -> int:
    key = args.api_key or (input("API key: ").strip() if sys.stdin.isatty() else sys.stdin.read().strip())
    client.api_key = key
    client.call("GET", "/v2/sandboxes?limit=1")  # fails with 401 on a wrong key
    path = save_credentials(client.url, key)
    print(f"credentials for {client.url} saved to {path}")
    return 0


def _create(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"templateID": args.template, "metadata": {}, "envVars": {}}
    if args.timeout is not None:
        body["timeout"] = args.timeout
    if args.cpu is not None:
        body["cpuCount"] = args.cpu
    if args.memory is not None:
        body["memoryMB"] = args.memory
    for item in args.env or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ApiError(0, f"--env expects KEY=VALUE, got {item!r}")
        body["envVars"][key] = value
    result: dict[str, Any] = client.call("POST", "/v2/sandboxes", body).json()
    return result


def cmd_start(args: argparse.Namespace, client: Client) -> int:
    from aenv.cli.shell import attach_shell

    sbx = _create(client, args)
    if args.detach or not sys.stdin.isatty():
        emit(sbx, ("sandboxID", "templateID", "envdVersion"), args.output == "json")
        return 0
    print(f"sandbox {sbx['sandboxID']} (exit the shell to leave it running; "
          f"`aenv rm {sbx['sandboxID']}` removes it)", file=sys.stderr)
    return attach_shell(client, sbx["sandboxID"], sbx.get("envdAccessToken"))


def cmd_exec(args: argparse.Namespace, client: Client) -> int:
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise ApiError(0, "exec needs a command: aenv exec ID -- CMD [ARGS...]")
    token = client.call("GET", f"/sandboxes/{args.sandbox_id}").json().get("envdAccessToken")
    process: dict[str, Any] = {"cmd": "/bin/sh", "args": ["-c", shlex.join(argv)]}
    if args.cwd:
        process["cwd"] = args.cwd
    if args.env:
        process["envs"] = dict(e.partition("=")[::2] for e in args.env)
    message: dict[str, Any] = {"process": process, "stdin": False}
    exit_code = 0
    for msg in client.stream(args.sandbox_id, token, "process.Process/Start", message,
                             timeout_ms=args.timeout * 1000 if args.timeout else None,
                             user=args.user):
        event = msg.get("event", {})
        data = event.get("data")
        if data:
            for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
                if name in data:
                    stream.buffer.write(base64.b64decode(data[name]))
                    stream.flush()
        if "end" in event:
            exit_code = int(event["end"].get("exitCode", 0))
    return exit_code


def cmd_ls(args: argparse.Namespace, client: Client) -> int:
    query = f"?state={args.state}" if args.state else ""
    rows = client.call("GET", f"/v2/sandboxes{query}").json()
    emit(rows, SANDBOX_COLUMNS, args.output == "json")
    return 0


def cmd_rm(args: argparse.Namespace, client: Client) -> int:
    return each_target(args.sandbox_ids,
                       lambda sandbox_id: client.call("DELETE", f"/sandboxes/{sandbox_id}"))


def cmd_timeout(args: argparse.Namespace, client: Client) -> int:
    client.call("POST", f"/sandboxes/{args.sandbox_id}/timeout", {"timeout": args.seconds})
    info = client.call("GET", f"/sandboxes/{args.sandbox_id}").json()
    emit(info, ("sandboxID", "state", "endAt"), args.output == "json")
    return 0


def cmd_info(args: argparse.Namespace, client: Client) -> int:
    info = client.call("GET", f"/sandboxes/{args.sandbox_id}").json()
    info.pop("envdAccessToken", None)
    emit(info, (*SANDBOX_COLUMNS, "runtime"), args.output == "json")
    return 0


def cmd_pause(args: argparse.Namespace, client: Client) -> int:
    for sandbox_id in args.sandbox_ids:
        client.call("POST", f"/sandboxes/{sandbox_id}/pause", {})
        print(sandbox_id)
    return 0


def cmd_resume(args: argparse.Namespace, client: Client) -> int:
    body = {"timeout": args.timeout} if args.timeout else {}
    client.call("POST", f"/v2/sandboxes/{args.sandbox_id}/connect", body)
    info = client.call("GET", f"/sandboxes/{args.sandbox_id}").json()
    emit(info, ("sandboxID", "state", "endAt"), args.output == "json")
    return 0


def cmd_fork(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = {"count": args.count}
    if args.timeout:
        body["timeout"] = args.timeout
    results = client.call("POST", f"/sandboxes/{args.sandbox_id}/fork", body).json()
    rows = [{"sandboxID": r["sandbox"]["sandboxID"], "result": "ok"} if "sandbox" in r
            else {"sandboxID": "-", "result": r["error"]["message"]} for r in results]
    emit(results if args.output == "json" else rows, ("sandboxID", "result"),
         args.output == "json")
    return 0 if all("sandbox" in r for r in results) else 1


def cmd_snapshot(args: argparse.Namespace, client: Client) -> int:
    columns = ("snapshotID", "names", "sandboxID", "createdAt")
    if args.action == "create":
        if not args.target:
            raise ApiError(0, "snapshot create needs a sandbox id")
        body = {"name": args.name} if args.name else {}
        emit(client.call("POST", f"/sandboxes/{args.target}/snapshots", body).json(), columns,
             args.output == "json")
    elif args.action == "ls":
        query = f"?sandboxID={args.target}" if args.target else ""
        emit(client.call("GET", f"/snapshots{query}").json(), columns, args.output == "json")
    else:
        if not args.target:
            raise ApiError(0, "snapshot rm needs a snapshot id or name")
        client.call("DELETE", f"/templates/{args.target}")
        print(args.target)
    return 0


def cmd_templates(args: argparse.Namespace, client: Client) -> int:
    # watch follows a build (cli/build.py); ls and rm are the image routes' (cli/pull.py).
    if args.action == "watch":
        return cmd_template_watch(args, client)
    return cmd_template(args, client)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aenv", description="Sandboxes for AI agents and RL.")
    parser.add_argument("--url", help="server URL (default $AENV_URL or http://127.0.0.1:8000)")
    parser.add_argument("--api-key", help="API key (default $AENV_API_KEY or `aenv auth`)")
    parser.add_argument("--output", "-o", choices=("table", "json"), default="table")
    sub = parser.add_subparsers(dest="verb", required=True)
    # `-o json` is also accepted after the verb (`aenv ls -o json`); SUPPRESS keeps the
    # top-level value when the verb does not repeat it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--output", "-o", choices=("table", "json"), default=argparse.SUPPRESS)

    p = sub.add_parser("serve", help="run a server on this machine")
    p.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:8000)")
    p.add_argument("--home", help="state directory (default $AENV_HOME or /var/lib/aenv)")
    p.add_argument("--config", help="TOML config file (default $AENV_HOME/config.toml)")
    p.add_argument("--cluster", metavar="ETCD_URL",
                   help="join the cluster whose etcd is here (comma-separated endpoints)")
    p.add_argument("--advertise", metavar="URL",
                   help="with --cluster: the URL gateways reach this node at (default: --listen)")
    p.add_argument("--node-id", help="with --cluster: this node's id (default: kept in the home)")

    from aenv.cluster.commands import add_parsers

    add_parsers(sub, common)

    p = sub.add_parser("auth", parents=[common], help="save the server URL and API key for later commands")
    p.add_argument("api_key", nargs="?", help="the key printed by `aenv serve` (else read stdin)")

    p = sub.add_parser("start", parents=[common], help="create a sandbox and attach a shell")
    p.add_argument("template", nargs="?", default="base")
    p.add_argument("--detach", "-d", action="store_true", help="print the sandbox and return")
    p.add_argument("--timeout", type=int, help="time to live in seconds")
    p.add_argument("--cpu", type=int, help="CPU count (default: the template's)")
    p.add_argument("--memory", type=int, help="memory limit in MiB (default: the template's)")
    p.add_argument("--env", "-e", action="append", help="KEY=VALUE for every process")

    p = sub.add_parser("connect", parents=[common], help="attach a shell to a running sandbox")
    p.add_argument("sandbox_id")

    p = sub.add_parser("upload", parents=[common],
                       help="copy a file or directory into a sandbox: aenv upload ID LOCAL REMOTE")
    p.add_argument("sandbox_id")
    p.add_argument("local")
    p.add_argument("remote", help="destination path (ending in / : keep the file's name)")
    p.add_argument("--user", help="owner of the written files (default: the template's user)")

    p = sub.add_parser("download", parents=[common],
                       help="copy a file or directory out of a sandbox: aenv download ID REMOTE LOCAL")
    p.add_argument("sandbox_id")
    p.add_argument("remote")
    p.add_argument("local", help="destination path (an existing directory: keep the name)")
    p.add_argument("--user", help="read as this user (default: the template's user)")

    p = sub.add_parser("exec", parents=[common], help="run a command in a sandbox: aenv exec ID -- CMD...")
    p.add_argument("sandbox_id")
    p.add_argument("--cwd")
    p.add_argument("--user")
    p.add_argument("--env", "-e", action="append")
    p.add_argument("--timeout", type=int, help="kill the command after this many seconds")
    p.add_argument("command", nargs=argparse.REMAINDER)

    p = sub.add_parser("ls", parents=[common], help="list sandboxes")
    p.add_argument("--state", help="running, paused or running,paused")

    p = sub.add_parser("rm", parents=[common], help="remove sandboxes")
    p.add_argument("sandbox_ids", nargs="+")

    p = sub.add_parser("timeout", parents=[common], help="set a sandbox's time to live from now")
    p.add_argument("sandbox_id")
    p.add_argument("seconds", type=int)

    p = sub.add_parser("pause", help="pause sandboxes (memory and processes kept on disk)",
                       parents=[common])
    p.add_argument("sandbox_ids", nargs="+")

    p = sub.add_parser("resume", help="resume a paused sandbox", parents=[common])
    p.add_argument("sandbox_id")
    p.add_argument("--timeout", type=int, help="time to live from now, seconds")

    p = sub.add_parser("fork", help="fork a running sandbox into N independent children",
                       parents=[common])
    p.add_argument("sandbox_id")
    p.add_argument("-n", "--count", type=int, default=1)
    p.add_argument("--timeout", type=int, help="children's time to live (default: the parent's)")

    p = sub.add_parser("snapshot", help="snapshot create ID [--name N] | ls [ID] | rm SNAPSHOT",
                       parents=[common])
    p.add_argument("action", choices=("create", "ls", "rm"))
    p.add_argument("target", nargs="?")
    p.add_argument("--name")

    p = sub.add_parser("pull", parents=[common], help="pull an OCI image into a template")
    p.add_argument("image", help="image reference, e.g. alpine, python:3.12, host:5000/repo:tag")
    p.add_argument("--name", help="template name (default: the normalised image reference)")
    p.add_argument("--insecure", action="store_true", help="plain-HTTP registry")

    p = sub.add_parser("build", parents=[common],
                       help="build a template from a Dockerfile: aenv build Dockerfile --name N")
    p.add_argument("dockerfile", help="path of the Dockerfile")
    p.add_argument("--name", required=True, help="template name (a rebuild replaces it)")
    p.add_argument("--context", help="build context directory (default: the Dockerfile's)")
    p.add_argument("--build-arg", action="append", help="KEY=VALUE for an ARG")
    p.add_argument("--start-cmd", help="start command (default: ENTRYPOINT + CMD)")
    p.add_argument("--ready-cmd", help="the template is captured once this exits 0")

    p = sub.add_parser("template", parents=[common],
                       help="template ls | rm TEMPLATE... | watch TEMPLATE [BUILD]")
    p.add_argument("action", choices=("ls", "rm", "watch"))
    p.add_argument("targets", nargs="*",
                   help="template ids or names (rm); a template and optionally a build (watch)")

    sub.add_parser("cache", parents=[common],
                   help="the image layer cache: size, limit, hits, misses, evictions, layers")

    p = sub.add_parser("info", parents=[common], help="show one sandbox")
    p.add_argument("sandbox_id")
    return parser


CLIENT_VERBS: dict[str, Callable[[argparse.Namespace, Client], int]] = {
    "auth": cmd_auth, "start": cmd_start, "exec": cmd_exec, "ls": cmd_ls, "rm": cmd_rm,
    "timeout": cmd_timeout, "info": cmd_info, "pause": cmd_pause, "resume": cmd_resume,
    "fork": cmd_fork, "snapshot": cmd_snapshot, "pull": cmd_pull,
    "template": cmd_templates,
    "build": cmd_build, "connect": cmd_connect, "upload": cmd_upload, "download": cmd_download,
    "cache": cmd_cache,
}


CLUSTER_VERBS = ("gateway", "scheduler", "cluster", "node")  # aenv.cluster.commands


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verb == "serve":
        return cmd_serve(args)
    if args.verb in CLUSTER_VERBS:
        from aenv.cluster.commands import run_verb

        return run_verb(args)
    client = Client.from_env(args.url, args.api_key)
    try:
        return CLIENT_VERBS[args.verb](args, client)
    except ApiError as exc:
        if args.output == "json":
            json.dump({"error": {"code": exc.status, "message": exc.message}}, sys.stderr)
            sys.stderr.write("\n")
        else:
            print(f"aenv: {exc.message if exc.status == 0 else exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
