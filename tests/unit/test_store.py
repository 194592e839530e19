from datetime import UTC, datetime, timedelta
from pathlib import Path

from aenv.orchestrator.models import SandboxRecord, SandboxState, TemplateRecord
from aenv.orchestrator.store import Store


def _record(sandbox_id: str) -> SandboxRecord:
    now = datetime.now(UTC)
    return SandboxRecord(sandbox_id=sandbox_id, template_id="base", client_id="c", state=SandboxState.RUNNING,
                         started_at=now, end_at=now + timedelta(seconds=60), cpu_count=2, memory_mb=512,
                         disk_size_mb=1024, envd_access_token="t", metadata={"k": "v"},
                         handle={"pid": 42})


def test_records_survive_reopen(tmp_path: Path) -> None:
    db = tmp_path / "db.sqlite3"
    store = Store(db)
    store.put_sandbox(_record("a" * 20))
    store.put_template(TemplateRecord("tpl1", ["base", "b2"], ["layer1"], 2, 512, 1024))
    store.close()

    store = Store(db)
    rec = store.get_sandbox("a" * 20)
    assert rec is not None and rec.state is SandboxState.RUNNING and rec.handle == {"pid": 42}
    assert rec.metadata == {"k": "v"} and rec.end_at > rec.started_at
    found = store.find_template("b2")
    assert found is not None and found.template_id == "tpl1" and found.layers == ["layer1"]
    assert store.find_template("tpl1") is not None
    assert store.find_template("nope") is None
    store.delete_sandbox("a" * 20)
    assert store.get_sandbox("a" * 20) is None
    store.delete_template("tpl1")
    assert store.find_template("b2") is None
