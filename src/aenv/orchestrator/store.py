"""The durable record store: sandboxes and templates in SQLite (WAL), one file per node.

Records survive a server restart (and `kill -9`: every write is a committed transaction).
Calls are synchronous and sub-millisecond; the orchestrator calls them from the event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sqlite3
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from aenv.orchestrator.models import SandboxRecord, SandboxState, TemplateRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    started_at TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS templates (
    template_id TEXT PRIMARY KEY,
    body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS template_names (
    name TEXT PRIMARY KEY,
    template_id TEXT NOT NULL REFERENCES templates(template_id) ON DELETE CASCADE
);
"""


def _to_json(record: Any) -> str:
    def default(value: Any) -> Any:
        if isinstance(value, datetime):
            return value.isoformat()
        raise TypeError(type(value))

    return json.dumps(dataclasses.asdict(record), default=default)


def _sandbox_from_json(body: str) -> SandboxRecord:
    raw = json.loads(body)
    raw["state"] = SandboxState(raw["state"])
    raw["started_at"] = datetime.fromisoformat(raw["started_at"])
    raw["end_at"] = datetime.fromisoformat(raw["end_at"])
    return SandboxRecord(**raw)


def _template_from_json(body: str) -> TemplateRecord:
    raw = json.loads(body)
    if raw.get("created_at"):
        raw["created_at"] = datetime.fromisoformat(raw["created_at"])
    return TemplateRecord(**raw)


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # The records hold every sandbox's envd token: the file is the server's alone, and
        # SQLite gives the -wal and -shm files it creates the database file's mode.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        for name in (path.name, path.name + "-wal", path.name + "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.chmod(path.with_name(name), 0o600)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # sandboxes
    def put_sandbox(self, rec: SandboxRecord) -> None:
        self._db.execute(
            "INSERT INTO sandboxes(sandbox_id, started_at, body) VALUES (?, ?, ?) "
            "ON CONFLICT(sandbox_id) DO UPDATE SET started_at=excluded.started_at, body=excluded.body",
            (rec.sandbox_id, rec.started_at.isoformat(), _to_json(rec)),
        )

    def get_sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        row = self._db.execute("SELECT body FROM sandboxes WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return _sandbox_from_json(row[0]) if row else None

    def delete_sandbox(self, sandbox_id: str) -> None:
        self._db.execute("DELETE FROM sandboxes WHERE sandbox_id=?", (sandbox_id,))

    def iter_sandboxes(self) -> Iterator[SandboxRecord]:
        for (body,) in self._db.execute("SELECT body FROM sandboxes ORDER BY started_at, sandbox_id"):
            yield _sandbox_from_json(body)

    # templates
    def put_template(self, rec: TemplateRecord) -> None:
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO templates(template_id, body) VALUES (?, ?) "
                "ON CONFLICT(template_id) DO UPDATE SET body=excluded.body",
                (rec.template_id, _to_json(rec)),
            )
            self._db.execute("DELETE FROM template_names WHERE template_id=?", (rec.template_id,))
            for name in rec.names:
                self._db.execute(
                    "INSERT OR REPLACE INTO template_names(name, template_id) VALUES (?, ?)",
                    (name, rec.template_id),
                )

    def find_template(self, id_or_name: str) -> TemplateRecord | None:
        row = self._db.execute(
            "SELECT body FROM templates WHERE template_id=? UNION ALL "
            "SELECT t.body FROM templates t JOIN template_names n ON n.template_id=t.template_id "
            "WHERE n.name=? LIMIT 1",
            (id_or_name, id_or_name),
        ).fetchone()
        return _template_from_json(row[0]) if row else None

    def iter_templates(self) -> Iterator[TemplateRecord]:
        for (body,) in self._db.execute("SELECT body FROM templates ORDER BY template_id"):
            yield _template_from_json(body)

    def delete_template(self, template_id: str) -> None:
        self._db.execute("DELETE FROM templates WHERE template_id=?", (template_id,))
