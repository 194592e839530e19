"""Sandbox lifecycle: the state machine, TTL expiry, and the durable record store.

Owns: sandbox and template records (SQLite under AENV_HOME), ids and tokens, state
transitions and their locking, the TTL sweeper. Talks to runtimes only through
`aenv.runtime.RuntimeDriver`. Must not touch: HTTP (the api package maps its errors) or any
driver internals.
"""
