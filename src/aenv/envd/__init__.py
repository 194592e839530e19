"""envd: the agent inside every sandbox (port 49983), our implementation of E2B's envd protocol.

Owns: the Connect-protocol process and filesystem services, `/files`, `/health`, access-token
checks, process supervision (it is PID 1 of a container sandbox and reaps orphans).
Must not touch: anything outside the sandbox. It imports ONLY the Python standard library,
because it runs on the bundled runtime python inside arbitrary template userlands.
"""
