"""`aenv pull`, `aenv template ls|rm` and `aenv cache`: client side of the image routes.

Owns: rendering the pull's NDJSON progress stream (one bar per layer on a terminal, one line
per layer state change otherwise) and the template listing. Must not touch: anything on
the server side; talks HTTP only through `cli.client.Client`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from aenv.cli.client import ApiError, Client
from aenv.cli.output import each_target, emit

TEMPLATE_COLUMNS = ("templateID", "names", "kind", "sourceImage", "defaultUser", "createdAt")
_ACTIVE = {"downloading": "downloading", "verifying": "verifying", "extracting": "extracting"}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}MB"


class LayerBars:
    """One progress line per layer. On a TTY the block of lines is redrawn in place."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.layers: dict[str, dict[str, Any]] = {}
        self._drawn = 0
        self._last_draw = 0.0

    def resolved(self, event: dict[str, Any]) -> None:
        self.stream.write(f"{event['image']} ({event['platform']}) {event['digest']}\n")
        for layer in event.get("layers", []):
            self.layers[layer["digest"]] = {"state": "waiting", "done": 0,
                                            "total": layer.get("size") or 0}
        self.draw(force=True)

    def layer(self, event: dict[str, Any]) -> None:
        entry = self.layers.setdefault(event["digest"], {"state": "", "done": 0, "total": 0})
        changed = entry["state"] != event["state"]
        entry.update(state=event["state"], done=event["done"], total=event["total"])
        if self.tty:
            self.draw(force=changed)
        elif changed and event["state"] in ("done", "exists", "downloading", "extracting"):
            self.stream.write(f"{event['digest'][7:19]}: {event['state']} {_mb(event['total'])}\n")
            self.stream.flush()

    def _line(self, digest: str, entry: dict[str, Any]) -> str:
        total, done, state = entry["total"], entry["done"], entry["state"]
        frac = 1.0 if state in ("done", "exists") else (done / total if total else 0.0)
        width = 24
        fill = int(width * min(frac, 1.0))
        return (f"{digest[7:19]} [{'#' * fill}{'-' * (width - fill)}] {int(100 * frac):3d}% "
                f"{_mb(done):>9}/{_mb(total):<9} {state}")

    def draw(self, force: bool = False) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        out = [f"\x1b[{self._drawn}F"] if self._drawn else []
        out += [f"\x1b[2K{self._line(d, e)}\n" for d, e in self.layers.items()]
        self._drawn = len(self.layers)
        self.stream.write("".join(out))
        self.stream.flush()


def cmd_pull(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = {"image": args.image, "insecure": bool(args.insecure)}
    if args.name:
        body["name"] = args.name
    bars = LayerBars(sys.stderr)
    started = time.monotonic()
    template: dict[str, Any] | None = None
    for event in client.stream_lines("POST", "/aenv/images/pull", body):
        kind = event.get("type")
        if kind == "resolved":
            bars.resolved(event)
        elif kind == "layer":
            bars.layer(event)
        elif kind == "template":
            template = event["template"]
        elif kind == "error":
            bars.draw(force=True)
            raise ApiError(int(event.get("status", 0)), str(event.get("message", "pull failed")))
    bars.draw(force=True)
    if template is None:
        raise ApiError(0, "the server ended the pull without a result")
    if args.output == "json":
        emit(template, TEMPLATE_COLUMNS, True)
    else:
        print(f"pulled {args.image} in {time.monotonic() - started:.1f}s: template "
              f"{template['templateID']} ({', '.join(template['names'])}); "
              f"start it with `aenv start {template['names'][0]}`")
    return 0


def cmd_template(args: argparse.Namespace, client: Client) -> int:
    rows: list[dict[str, Any]] = client.call("GET", "/templates").json()
    if args.action == "ls":
        shown = [{**r, "names": ",".join(r.get("names", []))} for r in rows]
        emit(rows if args.output == "json" else shown, TEMPLATE_COLUMNS, args.output == "json")
        return 0
    if not args.targets:
        raise ApiError(0, "template rm needs template ids or names")

    def delete(target: str) -> None:
        # Names may contain '/' (image references): delete by id, found by id or name.
        match = next((r for r in rows if r["templateID"] == target or target in r.get("names", [])),
                     None)
        if match is None:
            raise ApiError(404, f"template '{target}' not found")
        client.call("DELETE", f"/templates/{match['templateID']}")

    return each_target(args.targets, delete)


CACHE_COLUMNS = ("layer", "bytes", "lastUsed", "inUse", "source")


def cmd_cache(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = client.call("GET", "/aenv/images/cache").json()
    if args.output == "json":
        print(json.dumps(body, indent=2))
        return 0
    limit = body["maxBytes"]
    print(f"image layer cache: {_mb(body['bytes'])} of {_mb(limit) if limit else 'unbounded'} "
          f"in {body['layers']} layers ({body['held']} in use){' OVER LIMIT' if body['overLimit'] else ''}; "
          f"hits {body['hits']}, misses {body['misses']}, evictions {body['evictions']} "
          f"({_mb(body['evictedBytes'])})")
    rows = [{**r, "layer": r["layer"][:28], "bytes": _mb(r["bytes"]),
             "lastUsed": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["lastUsed"]))}
            for r in body["entries"]]
    emit(rows, CACHE_COLUMNS, False)
    return 0
