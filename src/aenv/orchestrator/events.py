"""Sandbox logs: lifecycle events the manager records, plus envd's own log, bounded.

Owns: the event log of every sandbox (created, paused, resumed, forked, snapshot, killed,
died with its reason, expired, failed operations), kept in SQLite (its own file next to the
record store, WAL) so that it survives a restart and outlives the sandbox: at most
`max_per_sandbox` entries per sandbox (the oldest go first) and none older than `max_age_s`
(pruned as entries are written); the reading of envd's log file from a sandbox's writable
layer (`/run/aenv/envd.log`, written by envd in every container sandbox), merged in at query
time and copied into the store when the sandbox goes (its last `ENVD_TAIL_KEPT` lines); the
query semantics of E2B's `GET /v2/sandboxes/{id}/logs` (`cursor` in ms, `limit`, `direction`,
minimum `level`, `search`). Listeners (`on_event`) see every recorded event: the Prometheus
collector (`api/prom.py`) times operations with them.
Must not touch: sandbox records (the manager's), the sandbox's files other than reading the
envd log, HTTP (the routes shape the answers).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}
MAX_PER_SANDBOX = 2000
MAX_AGE_S = 7 * 24 * 3600
MAX_ROWS = 1_000_000  # in all: past this the oldest entries go, whatever their sandbox
PRUNE_EVERY = 256  # writes between two age/total prunes
ENVD_LOG = "run/aenv/envd.log"  # relative to the sandbox's root (its upper, for a container)
ENVD_TAIL_BYTES = 256 * 1024  # read at most this much of the end of envd's log
ENVD_TAIL_KEPT = 200  # lines of envd's log kept when a sandbox goes
_ENVD_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)Z? envd: (.*)$")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    ts_ms INTEGER NOT NULL,
    level TEXT NOT NULL,
    message TEXT NOT NULL,
    fields TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_sandbox ON events(sandbox_id, ts_ms, seq);
CREATE INDEX IF NOT EXISTS events_by_time ON events(ts_ms);
"""


@dataclass(frozen=True)
class LogEntry:
    """One line of a sandbox's log (E2B's `SandboxLogEntry`)."""
    timestamp_ms: int
    level: str
    message: str
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def timestamp(self) -> datetime:
        return datetime.fromtimestamp(self.timestamp_ms / 1000, UTC)


@dataclass(frozen=True)
class LogQuery:
    cursor_ms: int | None = None  # forward: from it (inclusive); backward: up to it
    limit: int = 1000
    forward: bool = True
    level: str | None = None  # the minimum level
    search: str | None = None  # a substring of the message, case-insensitive


def parse_envd_log(text: str, sandbox_id: str, since_ms: int) -> list[LogEntry]:
    """envd's log lines (`<UTC time> envd: <message>`; continuation lines of a traceback
    belong to the line before) from `since_ms` on."""
    out: list[LogEntry] = []
    for line in text.splitlines():
        m = _ENVD_LINE.match(line)
        if m is None:
            if out and line.strip():
                last = out[-1]
                out[-1] = LogEntry(last.timestamp_ms, "error", f"{last.message}\n{line}",
                                   last.fields)
            continue
        try:
            at = datetime.fromisoformat(m.group(1)).replace(tzinfo=UTC)
        except ValueError:
            continue
        ms = int(at.timestamp() * 1000)
        if ms < since_ms:
            continue
        message = m.group(2)
        level = "error" if "unexpected error" in message else "info"
        out.append(LogEntry(ms, level, message,
                            {"source": "envd", "logger": "envd", "sandboxID": sandbox_id}))
    return out


def read_tail(path: Path, limit: int = ENVD_TAIL_BYTES) -> str:
    """The end of a file (at most `limit` bytes, from a line start); '' if it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - limit)
        data = os.pread(fd, limit, start)
    except OSError:
        return ""
    finally:
        os.close(fd)
    if start > 0:
        data = data.split(b"\n", 1)[-1]
    return data.decode("utf-8", "replace")


class SandboxEvents:
    """The event log of every sandbox on this node (SQLite; ":memory:" for tests)."""

    def __init__(self, path: Path | str, max_per_sandbox: int = MAX_PER_SANDBOX,
                 max_age_s: int = MAX_AGE_S, max_rows: int = MAX_ROWS) -> None:
        if isinstance(path, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self.max_per_sandbox = max_per_sandbox
        self.max_age_s = max_age_s
        self.max_rows = max_rows
        self._writes = 0
        self._counts: dict[str, int] = {}  # sandbox -> entries, for those written this run
        self._listeners: list[Callable[[str, LogEntry], None]] = []
        self._last_ms: dict[str, int] = {}  # sandbox -> its last event's time (kept increasing)

    def close(self) -> None:
        self._db.close()

    def on_event(self, listener: Callable[[str, LogEntry], None]) -> None:
        self._listeners.append(listener)

    def record(self, sandbox_id: str, event: str, message: str, level: str = "info",
               **fields: object) -> LogEntry:
        """A lifecycle event (`event`: created, paused, ...; `fields` are strings in the
        answer: `seconds`, `reason`, ...). Never raises for a storage failure: a lost log
        line must not fail the operation it describes."""
        ms = int(time.time() * 1000)
        # Strictly increasing per sandbox: a forward cursor (last + 1 ms) never skips one.
        ms = max(ms, self._last_ms.get(sandbox_id, 0) + 1)
        self._last_ms[sandbox_id] = ms
        if len(self._last_ms) > 4 * self.max_per_sandbox:
            self._last_ms.pop(next(iter(self._last_ms)))
        entry = LogEntry(ms, level if level in LEVELS else "info", message,
                         {"source": "lifecycle", "event": event, "sandboxID": sandbox_id,
                          **{k: str(v) for k, v in fields.items() if v is not None}})
        self._insert(sandbox_id, [entry])
        for listener in self._listeners:
            with contextlib.suppress(Exception):
                listener(sandbox_id, entry)
        return entry

    def keep_envd_log(self, sandbox_id: str, root: Path, since_ms: int) -> None:
        """Copy the end of a sandbox's envd log into the store (the sandbox is going)."""
        entries = parse_envd_log(read_tail(root / ENVD_LOG), sandbox_id, since_ms)
        stored = self._max_stored_ms(sandbox_id, "envd")
        self._insert(sandbox_id, [e for e in entries if e.timestamp_ms > stored][-ENVD_TAIL_KEPT:])

    def _max_stored_ms(self, sandbox_id: str, source: str) -> int:
        row = self._db.execute(
            "SELECT MAX(ts_ms) FROM events WHERE sandbox_id=? AND json_extract(fields, "
            "'$.source')=?", (sandbox_id, source)).fetchone()
        return int(row[0]) if row and row[0] is not None else -1

    def _insert(self, sandbox_id: str, entries: list[LogEntry]) -> None:
        if not entries:
            return
        try:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany(
                    "INSERT INTO events(sandbox_id, ts_ms, level, message, fields) "
                    "VALUES (?, ?, ?, ?, ?)",
                    [(sandbox_id, e.timestamp_ms, e.level, e.message, json.dumps(e.fields))
                     for e in entries])
                count = self._counts.get(sandbox_id)
                if count is None:
                    count = self._db.execute("SELECT COUNT(*) FROM events WHERE sandbox_id=?",
                                             (sandbox_id,)).fetchone()[0]
                else:
                    count += len(entries)
                if count > self.max_per_sandbox:
                    self._db.execute(
                        "DELETE FROM events WHERE seq IN (SELECT seq FROM events WHERE "
                        "sandbox_id=? ORDER BY ts_ms, seq LIMIT ?)",
                        (sandbox_id, count - self.max_per_sandbox))
                    count = self.max_per_sandbox
                self._counts[sandbox_id] = count
        except sqlite3.Error:
            return
        self._writes += 1
        if self._writes % PRUNE_EVERY == 0:
            self.prune()

    def prune(self, now_ms: int | None = None) -> None:
        """Entries older than `max_age_s` go; past `max_rows` in all, the oldest go."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        try:
            self._db.execute("DELETE FROM events WHERE ts_ms < ?",
                             (now_ms - self.max_age_s * 1000,))
            total = self._db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
            if total > self.max_rows:
                self._db.execute("DELETE FROM events WHERE seq IN (SELECT seq FROM events "
                                 "ORDER BY ts_ms, seq LIMIT ?)", (total - self.max_rows,))
        except sqlite3.Error:
            return
        self._counts.clear()

    def known(self, sandbox_id: str) -> bool:
        """Whether any entry of this sandbox is kept."""
        row = self._db.execute("SELECT 1 FROM events WHERE sandbox_id=? LIMIT 1",
                               (sandbox_id,)).fetchone()
        return row is not None

    def stored(self, sandbox_id: str) -> list[LogEntry]:
        rows = self._db.execute(
            "SELECT ts_ms, level, message, fields FROM events WHERE sandbox_id=? "
            "ORDER BY ts_ms, seq", (sandbox_id,)).fetchall()
        return [LogEntry(int(ts), str(level), str(msg), dict(json.loads(fields)))
                for ts, level, msg, fields in rows]

    def query(self, sandbox_id: str, q: LogQuery, live: Iterable[LogEntry] = ()
              ) -> list[LogEntry]:
        """The sandbox's entries (stored, plus `live` ones read from the running sandbox:
        envd lines already stored are not repeated), filtered and paged as E2B does."""
        stored = self.stored(sandbox_id)
        have = {(e.timestamp_ms, e.message) for e in stored}
        merged = stored + [e for e in live if (e.timestamp_ms, e.message) not in have]
        merged.sort(key=lambda e: e.timestamp_ms)
        return select(merged, q)


def select(entries: list[LogEntry], q: LogQuery) -> list[LogEntry]:
    """Filter (level, search) and page (cursor, direction, limit) entries sorted by time."""
    floor = LEVELS.get(q.level or "debug", 0)
    needle = (q.search or "").lower()
    picked = [e for e in entries if LEVELS.get(e.level, 1) >= floor
              and (not needle or needle in e.message.lower())]
    if q.forward:
        start = q.cursor_ms or 0
        return [e for e in picked if e.timestamp_ms >= start][:q.limit]
    end = q.cursor_ms
    before = [e for e in picked if end is None or e.timestamp_ms <= end]
    return before[::-1][:q.limit]
