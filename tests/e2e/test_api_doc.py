"""`docs/api.md`'s "E2B API coverage" table is true: it lists exactly the paths the installed
e2b SDK calls (read from its generated api modules), and a path is `implemented` or
`differs` exactly when this server serves it (its `/openapi.json`, generated from the route
table, or, for what is routed outside it such as the volume content API, a probe the router
does not answer with its own 404 or 405)."""

from __future__ import annotations

import re
from pathlib import Path

import e2b
import httpx
import pytest

from aenv.devserver import ServerProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
SDK = Path(e2b.__file__).parent
SDK_API_DIRS = ("api/client/api", "volume/client/api")
STATUSES = {"implemented", "differs", "not implemented"}
_PARAM = re.compile(r"{[^}]+}")
_ROW = re.compile(r"^\| `(GET|POST|PUT|PATCH|DELETE) (/[^`]*)` \| ([a-z ]+) \|")


def _norm(path: str) -> str:
    return _PARAM.sub("{}", path)


def sdk_paths() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for sub in SDK_API_DIRS:
        for module in (SDK / sub).rglob("*.py"):
            text = module.read_text()
            method = re.search(r'"method": "(\w+)"', text)
            url = re.search(r'"url": f?"([^"]+)"', text)
            if method and url:
                found.add((method.group(1).upper(), _norm(url.group(1))))
    assert len(found) > 50, found  # the SDK's layout is what this parser expects
    return found


def doc_rows() -> dict[tuple[str, str], str]:
    text = DOC.read_text()
    section = text.split("## E2B API coverage", 1)[1].split("\n## ", 1)[0]
    rows: dict[tuple[str, str], str] = {}
    for line in section.splitlines():
        m = _ROW.match(line)
        if m is None:
            continue
        key = (m.group(1), _norm(m.group(2)))
        assert key not in rows, f"{key} twice in docs/api.md"
        assert m.group(3) in STATUSES, line
        rows[key] = m.group(3)
    return rows


@pytest.fixture(scope="module")
def served(server: ServerProcess) -> set[tuple[str, str]]:
    doc = httpx.get(f"{server.url}/openapi.json").json()
    return {(method.upper(), _norm(path)) for path, ops in doc["paths"].items()
            for method in ops}


def _probe(server: ServerProcess, method: str, path: str) -> bool:
    """Whether something other than the router answers `method path` (with made-up ids)."""
    url = server.url + path.replace("{}", "zzprobezz")
    r = httpx.request(method, url, headers={"X-API-Key": server.api_key}, timeout=30,
                      content=b"" if method != "GET" else None)
    if r.status_code == 405:
        return False
    try:
        message = r.json().get("message")
    except ValueError:
        message = None
    return not (r.status_code == 404 and message == "Not Found")


def test_the_table_lists_every_sdk_path() -> None:
    rows, sdk = set(doc_rows()), sdk_paths()
    assert sdk - rows == set(), "E2B paths missing from docs/api.md"
    assert rows - sdk == set(), "docs/api.md lists paths the SDK does not call"


def test_each_status_is_true_to_the_routes(server: ServerProcess,
                                           served: set[tuple[str, str]]) -> None:
    wrong = []
    for (method, path), status in sorted(doc_rows().items()):
        routed = (method, path) in served or _probe(server, method, path)
        if routed != (status != "not implemented"):
            wrong.append(f"{method} {path}: documented {status!r}, "
                         f"{'served' if routed else 'not served'}")
    assert not wrong, "\n".join(wrong)
