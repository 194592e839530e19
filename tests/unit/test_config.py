from pathlib import Path

import pytest

from aenv.config import load_config
from aenv.errors import AenvError, ErrorCode


def test_defaults_file_and_env_precedence(tmp_path: Path) -> None:
    cfg_file = tmp_path / "config.toml"
    cfg_file.write_text('[sandbox]\nmemory_mb = 1024\ncpu_count = 4\n[server]\nlisten = "0.0.0.0:9000"\n')
    cfg = load_config({"AENV_HOME": str(tmp_path), "AENV_SANDBOX_CPU_COUNT": "1"})
    assert cfg.home == tmp_path
    assert cfg.sandbox.memory_mb == 1024  # from the file
    assert cfg.sandbox.cpu_count == 1  # env beats file
    assert cfg.server.listen == "0.0.0.0:9000"
    assert cfg.sandbox.timeout_s == 300  # embedded default


def test_bad_values_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(AenvError) as exc:
        load_config({"AENV_HOME": str(tmp_path), "AENV_SANDBOX_MEMORY_MB": "lots"})
    assert exc.value.code is ErrorCode.INVALID_ARGUMENT
    assert "sandbox.memory_mb" in exc.value.message
    (tmp_path / "config.toml").write_text("[sandbox]\nno_such_key = 1\n")
    with pytest.raises(AenvError, match="unknown key sandbox.no_such_key"):
        load_config({"AENV_HOME": str(tmp_path)})
    (tmp_path / "config.toml").write_text("[sandbox\n")
    with pytest.raises(AenvError, match="config"):
        load_config({"AENV_HOME": str(tmp_path)})


def test_snapshot_s3_needs_explicit_region(tmp_path: Path) -> None:
    env = {"AENV_HOME": str(tmp_path), "AENV_SNAPSHOT_BACKEND": "s3",
           "AENV_SNAPSHOT_S3_ENDPOINT": "http://127.0.0.1:9000", "AENV_SNAPSHOT_S3_BUCKET": "b"}
    cfg = load_config(env)
    with pytest.raises(AenvError, match="snapshot.s3_region"):
        cfg.snapshot.validate()
    cfg = load_config({**env, "AENV_SNAPSHOT_S3_REGION": "eu-west-1"})
    cfg.snapshot.validate()
    assert cfg.snapshot.s3_region == "eu-west-1"
