"""deploy/config.toml (installed as /etc/aenv/config.toml): every key of every section of
`aenv.config`, with its built-in default, commented out."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

from deploy_support import DEPLOY

from aenv.config import Config, load_config

TEMPLATE = DEPLOY / "config.toml"
KEY_LINE = re.compile(r"^# ([a-z][a-z0-9_]*) = (.+)$")


def commented_keys(text: str) -> dict[str, dict[str, str]]:
    """section -> key -> the TOML value text of each `# key = value` line."""
    out: dict[str, dict[str, str]] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
        elif (m := KEY_LINE.match(line)) and section:
            assert m[1] not in out[section], f"[{section}] {m[1]} shown twice"
            out[section][m[1]] = m[2]
    return out


def defaults() -> dict[str, dict[str, Any]]:
    cfg = Config()
    return {f.name: {k.name: getattr(getattr(cfg, f.name), k.name)
                     for k in dataclasses.fields(getattr(cfg, f.name))}
            for f in dataclasses.fields(cfg)}


def test_every_key_of_every_section_is_shown() -> None:
    shown = commented_keys(TEMPLATE.read_text())
    want = defaults()
    assert set(shown) == set(want), "sections differ from aenv.config.Config"
    for section, keys in want.items():
        missing = sorted(set(keys) - set(shown[section]))
        unknown = sorted(set(shown[section]) - set(keys))
        assert not missing, f"[{section}] lacks {missing} (deploy/config.toml, docs/operations.md)"
        assert not unknown, f"[{section}] shows keys aenv.config does not have: {unknown}"


def test_shown_values_are_the_defaults() -> None:
    shown = commented_keys(TEMPLATE.read_text())
    for section, keys in defaults().items():
        for key, default in keys.items():
            if default is None:
                continue  # unset by default: the line shows an example value
            value = tomllib.loads(f"v = {shown[section][key]}")["v"]
            assert value == (str(default) if isinstance(default, Path) else default), \
                f"{section}.{key}: the file says {value!r}, the default is {default!r}"


def test_file_as_shipped_changes_nothing() -> None:
    assert load_config(env={}, path=TEMPLATE) == load_config(env={}, path=Path("/nonexistent"))


def test_every_commented_line_is_valid_config(tmp_path: Path) -> None:
    """Uncommenting any key line gives a file the server accepts."""
    text = "\n".join(line[2:] if KEY_LINE.match(line) else line
                     for line in TEMPLATE.read_text().splitlines())
    path = tmp_path / "config.toml"
    path.write_text(text)
    load_config(env={}, path=path)  # raises on an unknown key or a badly typed value


def test_check_detects_a_missing_key(tmp_path: Path) -> None:
    text = TEMPLATE.read_text().replace("# pids_max = 1024\n", "")
    shown = commented_keys(text)
    assert "pids_max" not in shown["sandbox"] and "pids_max" in defaults()["sandbox"]
