"""The cluster's sub-commands of `aenv`: `gateway`, `scheduler`, `cluster up|down`, `node ls|drain`.

Imported by cli/main.py to build its parser, so only argparse at import time; each command
imports what it runs. Owns: the flags (deployment files run exactly
`aenv gateway --etcd URL --listen HOST:PORT` and `aenv scheduler --etcd URL --listen HOST:PORT`).
Must not touch: the node's own verbs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("gateway", help="run a cluster gateway: the E2B endpoint in front of the nodes")
    p.add_argument("--etcd", required=True, help="etcd URL(s), comma-separated")
    p.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (default 127.0.0.1:8080)")
    p.add_argument("--domain", help="host-based sandbox routing: <port>-<id>.<domain>")
    p.add_argument("--scheduler", action="append", default=[],
                   help="a scheduler URL to ask as well as those registered in etcd")

    p = sub.add_parser("scheduler", help="run a cluster scheduler (placement; one leader)")
    p.add_argument("--etcd", required=True, help="etcd URL(s), comma-separated")
    p.add_argument("--listen", default="127.0.0.1:9090", help="HOST:PORT (default 127.0.0.1:9090)")
    p.add_argument("--advertise", help="the URL others reach it at (default: from --listen)")

    p = sub.add_parser("cluster", help="cluster up --nodes N | down: a whole cluster on this machine")
    p.add_argument("action", choices=("up", "down"))
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--listen", default="127.0.0.1:8080", help="the gateway's HOST:PORT")
    p.add_argument("--home", default="/var/lib/aenv-cluster", help="where everything lives")
    p.add_argument("--schedulers", type=int, default=2, help="scheduler replicas")

    p = sub.add_parser("node", parents=[common], help="node ls | drain ID | undrain ID (at a gateway)")
    p.add_argument("action", choices=("ls", "drain", "undrain"))
    p.add_argument("node_id", nargs="?")


def _advertise(listen: str, given: str | None) -> str:
    if given:
        return given.rstrip("/")
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def run_verb(args: argparse.Namespace) -> int:
    from aenv.errors import AenvError

    try:
        if args.verb == "gateway":
            from aenv.cluster.gateway import build_gateway, protocol
            from aenv.cluster.serving import run, split_listen

            split_listen(args.listen)
            app, gateway = build_gateway(args.etcd, domain=args.domain,
                                         schedulers=args.scheduler)
            if not os.environ.get("AENV_API_KEY"):
                print(f"aenv: gateway API key: {gateway.api_key}", file=sys.stderr)
            print(f"aenv: gateway on http://{args.listen} (etcd {args.etcd})", file=sys.stderr)
            run(app, args.listen, http=protocol())
            return 0
        if args.verb == "scheduler":
            from aenv.cluster.scheduler import build_scheduler
            from aenv.cluster.serving import run, split_listen

            split_listen(args.listen)
            app, scheduler = build_scheduler(args.etcd, _advertise(args.listen, args.advertise),
                                             os.environ.get("AENV_API_KEY"))
            print(f"aenv: scheduler {scheduler.id} on http://{args.listen} (etcd {args.etcd})",
                  file=sys.stderr)
            run(app, args.listen)
            return 0
        if args.verb == "cluster":
            from aenv.cluster import up

            if args.action == "up":
                return up.cluster_up(args.nodes, args.listen, args.home, args.schedulers)
            return up.cluster_down(args.home)
        return _node(args)
    except AenvError as exc:
        print(f"aenv: {exc.message}", file=sys.stderr)
        return 2


def _node(args: argparse.Namespace) -> int:
    from aenv.cli.client import ApiError, Client
    from aenv.cli.output import emit

    client = Client.from_env(args.url, args.api_key)
    try:
        if args.action == "ls":
            rows = client.call("GET", "/nodes").json()
            for row in rows:
                use, cap = row.get("usage", {}), row.get("capacity", {})
                sbx = row.get("sandboxes", {})
                row["cpu"] = f"{use.get('allocatedCPU', '-')}/{cap.get('cpus', '-')}"
                row["running"] = sbx.get("running", 0)
                row["paused"] = sbx.get("paused", 0)
            emit(rows, ("nodeID", "url", "status", "cpu", "running", "paused"),
                 args.output == "json")
            return 0
        if not args.node_id:
            raise ApiError(0, f"node {args.action} needs a node id")
        client.call("DELETE" if args.action == "undrain" else "POST",
                    f"/nodes/{args.node_id}/drain")
        print(args.node_id)
        return 0
    except ApiError as exc:
        print(f"aenv: {exc.message if exc.status == 0 else exc}", file=sys.stderr)
        return 1
