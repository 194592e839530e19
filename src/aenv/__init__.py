"""aenv: self-hosted, E2B-compatible sandboxes for AI agents and agentic RL.

Package map (one concern per package):
  api/           HTTP edge: E2B control-plane routes, auth, routing of envd traffic.
  orchestrator/  sandbox lifecycle, state machine, TTLs, the durable record store.
  runtime/       the driver interface; runtime/<driver>/ one package per isolation technology.
  envd/          the in-sandbox agent (stdlib only: it runs on the bundled runtime python).
  storage/       on-disk layout: layers, sandbox workspaces.
  images/        building template root filesystems (the default `base` template).
  cli/           the `aenv` command.
  bench/         benchmarks printed by `make bench`.

This module must stay import-free: envd imports `aenv.envd` inside sandboxes, where only
the standard library exists.
"""

__version__ = "0.1.0"
