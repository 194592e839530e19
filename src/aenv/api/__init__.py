"""The HTTP edge: E2B-compatible control plane, API-key auth, and routing of sandbox traffic.

Owns: request parsing and validation, response shapes, mapping `AenvError` codes to HTTP
statuses (once, in `api.errors`), and the reverse proxy that carries envd (and any sandbox
port) traffic. Must not touch: runtime drivers or the store directly (it goes through the
orchestrator's `SandboxManager`).
"""
