"""The `aenv` command: `serve` runs a node; the other verbs are clients of its HTTP API.

Owns: argument parsing, output formatting (tables or `--output json`), finding the server
(`--url`/`AENV_URL`) and the key (`AENV_API_KEY` or the file written by `aenv auth`).
Must not touch: server internals, except `serve`, which builds the server from `aenv.api`.
"""
