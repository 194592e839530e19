"""Template builds (E2B's template API): steps run in a build sandbox, the result is a snapshot.

Modules: `envd_client` (talks to a sandbox's envd from the server), `context` (turns an
uploaded build-context archive into what a COPY/ADD step extracts), `builder` (the build
pipeline and build state), `dockerfile` (a Dockerfile subset as build steps; used by the CLI).
"""
