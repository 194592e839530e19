"""On-disk layout of a node's state under AENV_HOME.

Owns: where things live (the durable record database, secrets, read-only layers, sandbox
workspaces, run-time sockets and pid files). Must not touch: sandbox processes or HTTP.
"""
