#!/usr/bin/env bash
# Entry point of the aenv images (deploy/docker/Dockerfile.node, Dockerfile.control).
#
#   AENV_API_KEY_FILE=/run/secrets/aenv_api_key   the API key from a file (a Compose or
#                                                 Kubernetes secret) when AENV_API_KEY is unset
#   <image> serve ...  /  <image> gateway ...     a first argument that is not a program is an
#                                                 aenv sub-command: `aenv` is put in front
set -euo pipefail

if [[ -n ${AENV_API_KEY_FILE:-} && -z ${AENV_API_KEY:-} ]]; then
    [[ -r $AENV_API_KEY_FILE ]] || { echo "aenv-entrypoint: cannot read AENV_API_KEY_FILE=$AENV_API_KEY_FILE" >&2; exit 2; }
    AENV_API_KEY=$(tr -d '[:space:]' <"$AENV_API_KEY_FILE")
    export AENV_API_KEY
fi
unset AENV_API_KEY_FILE
if (($# == 0)); then
    set -- aenv --help
elif ! command -v "$1" >/dev/null 2>&1; then
    set -- aenv "$@"
fi
exec "$@"
