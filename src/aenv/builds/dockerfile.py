"""A Dockerfile subset as E2B template build steps (what `aenv build` sends).

Owns: parsing FROM (one stage), RUN, ENV, ARG, WORKDIR, USER, COPY/ADD (`--chown`, `--chmod`),
CMD and ENTRYPOINT (together: the template's start command); line continuations, comments,
exec (JSON) and shell forms; `$VAR`/`${VAR}` substitution from ENV and ARG in ENV, ARG,
WORKDIR, USER, COPY and ADD (RUN is left to the shell, as Docker does). Instructions with no
meaning for a sandbox template (EXPOSE, LABEL, VOLUME, ...) are skipped with a warning.
Standard library only; no I/O. Must not touch: HTTP, the build context files.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

IGNORED = frozenset({"EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "VOLUME",
                     "SHELL", "ONBUILD"})
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


class DockerfileError(ValueError):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"Dockerfile line {line}: {message}")
        self.line = line


@dataclass
class Dockerfile:
    from_image: str
    steps: list[dict[str, object]] = field(default_factory=list)  # {"type", "args"}
    start_cmd: str | None = None
    warnings: list[str] = field(default_factory=list)


def _lines(text: str) -> list[tuple[int, str]]:
    """Logical lines (continuations joined, comments and blanks dropped), with the number of
    the line each starts on."""
    out: list[tuple[int, str]] = []
    current, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction
        if not current:
            start = number
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        out.append((start, current.strip()))
        current = ""
    if current.strip():
        out.append((start, current.strip()))
    return out


def _exec_form(rest: str) -> list[str] | None:
    if not rest.startswith("["):
        return None
    try:
        value = json.loads(rest)
    except json.JSONDecodeError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def _command(rest: str) -> str:
    form = _exec_form(rest)
    return shlex.join(form) if form is not None else rest


def parse(text: str, build_args: dict[str, str] | None = None) -> Dockerfile:
    overrides = dict(build_args or {})
    values: dict[str, str] = {}  # ENV and ARG values known so far (for substitution)

    def sub(value: str) -> str:
        def one(m: re.Match[str]) -> str:
            name = m.group(1) or m.group(3)
            default = m.group(2)
            found = values.get(name)
            return found if found else (default or "")
        return _VAR.sub(one, value)

    result: Dockerfile | None = None
    entrypoint: str | None = None
    cmd: str | None = None
    for number, line in _lines(text):
        word, _, rest = line.partition(" ")
        instruction, rest = word.upper(), rest.strip()
        if instruction == "ARG" and result is None:
            continue  # ARG before FROM: only for FROM, which we do not substitute
        if instruction == "FROM":
            if result is not None:
                raise DockerfileError(number, "multi-stage builds (a second FROM) are not "
                                      "supported")
            parts = rest.split()
            if not parts or len(parts) not in (1, 3) or len(parts) == 3 and parts[1].upper() != "AS":
                raise DockerfileError(number, "FROM needs an image or template: FROM NAME [AS x]")
            result = Dockerfile(from_image=parts[0])
            continue
        if result is None:
            raise DockerfileError(number, f"{instruction} before FROM")
        known = {"RUN", "ENV", "ARG", "WORKDIR", "USER", "COPY", "ADD", "CMD", "ENTRYPOINT"}
        if instruction not in known and instruction not in IGNORED:
            raise DockerfileError(number, f"unknown instruction {instruction}")
        if not rest and instruction not in IGNORED:
            raise DockerfileError(number, f"{instruction} needs arguments")
        steps = result.steps
        if instruction == "RUN":
            steps.append({"type": "RUN", "args": [_command(rest)]})
        elif instruction == "ENV":
            pairs = _env_pairs(number, rest)
            for key, value in pairs:
                values[key] = sub(value)
            steps.append({"type": "ENV",
                          "args": [x for key, _ in pairs for x in (key, values[key])]})
        elif instruction == "ARG":
            key, eq, default = rest.partition("=")
            key = key.strip()
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise DockerfileError(number, f"invalid ARG name {key!r}")
            arg = overrides.pop(key) if key in overrides else (
                sub(_unquote(default)) if eq else None)
            if arg is None:
                continue  # declared without a value: nothing to set
            values[key] = arg
            steps.append({"type": "ARG", "args": [key, arg]})
        elif instruction == "WORKDIR":
            steps.append({"type": "WORKDIR", "args": [sub(_unquote(rest))]})
        elif instruction == "USER":
            steps.append({"type": "USER", "args": [sub(rest)]})
        elif instruction in ("COPY", "ADD"):
            steps.extend(_copy(number, instruction, rest, sub))
        elif instruction == "CMD":
            cmd = _command(rest)
        elif instruction == "ENTRYPOINT":
            entrypoint = _command(rest)
        elif instruction in IGNORED:
            result.warnings.append(f"line {number}: {instruction} is ignored")
        else:
            raise DockerfileError(number, f"unknown instruction {instruction}")
    if result is None:
        raise DockerfileError(0, "no FROM instruction")
    if overrides:
        result.warnings.append(f"build arguments not declared by an ARG: {', '.join(overrides)}")
    start = " ".join(part for part in (entrypoint, cmd) if part)
    result.start_cmd = start or None
    return result


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def _env_pairs(number: int, rest: str) -> list[tuple[str, str]]:
    first = rest.split(None, 1)[0]
    if "=" not in first:  # legacy form: ENV KEY the rest of the line
        key, _, value = rest.partition(" ")
        return [(key, value.strip())]
    try:
        words = shlex.split(rest)
    except ValueError as exc:
        raise DockerfileError(number, f"ENV: {exc}") from None
    pairs = []
    for word in words:
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise DockerfileError(number, f"ENV: expected KEY=VALUE, got {word!r}")
        pairs.append((key, value))
    return pairs


def _copy(number: int, instruction: str, rest: str, sub: Callable[[str], str]
          ) -> list[dict[str, object]]:
    chown = chmod = ""
    words = rest.split()
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0)[2:].partition("=")
        if flag == "chown":
            chown = sub(value)
        elif flag == "chmod":
            if not re.fullmatch(r"[0-7]{3,4}", value):
                raise DockerfileError(number, f"--chmod needs an octal mode, got {value!r}")
            chmod = value.zfill(4)
        elif flag == "from":
            raise DockerfileError(number, f"{instruction} --from (multi-stage) is not supported")
        else:
            raise DockerfileError(number, f"{instruction}: unsupported flag --{flag}")
    remainder = " ".join(words)
    paths = _exec_form(remainder)
    if paths is None:
        try:
            paths = shlex.split(remainder)
        except ValueError as exc:
            raise DockerfileError(number, f"{instruction}: {exc}") from None
    paths = [sub(p) for p in paths]
    if len(paths) < 2:
        raise DockerfileError(number, f"{instruction} needs a source and a destination")
    *sources, dest = paths
    if len(sources) > 1 and not dest.endswith("/"):
        raise DockerfileError(number, f"{instruction} with several sources needs a destination "
                              "directory ending in /")
    for src in sources:
        if src.startswith(("http://", "https://")):
            raise DockerfileError(number, f"{instruction} from a URL is not supported")
        if src.startswith(("/", "../")) or src == "..":
            raise DockerfileError(number, f"{instruction} source {src!r} is outside the context")
    return [{"type": instruction, "args": [src, dest, chown, chmod]} for src in sources]
