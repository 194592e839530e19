"""The OpenAPI 3.1 document of the control plane, generated from the code.

Paths and methods come from the Starlette route table the server serves; request bodies and
query parameters from each handler's `@accepts` declaration (`api/bodies.py`), whose pydantic
models are the ones `parse_body` validates with. Nothing here is written by hand but the error
shape, which `api/errors.py` produces for every failure. It must not describe the sandbox
proxy (envd's own API), which is not part of the control plane.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel
from starlette.routing import BaseRoute, Route

from aenv.api.bodies import accepted_by

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["code", "message"],
    "properties": {"code": {"type": "integer"}, "message": {"type": "string"},
                   "error_code": {"type": "string"}},
}
_PATH_PARAM = re.compile(r"{([^}:]+)(?::[^}]+)?}")


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _operation(route: Route, method: str, schemas: dict[str, Any]) -> dict[str, Any]:
    spec = accepted_by(route.endpoint)
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _PATH_PARAM.findall(route.path)]
    params += [{"name": q.name, "in": "query", "required": False,
                "schema": {"type": q.type}, **({"description": q.description}
                                               if q.description else {})}
               for q in spec.query]
    op: dict[str, Any] = {
        "operationId": re.sub(r"[^A-Za-z0-9]+", "_", f"{method}{route.path}").strip("_"),
        "responses": {"2XX": {"description": "success"}, "4XX": _error("invalid request"),
                      "5XX": _error("server or sandbox failure")},
    }
    if params:
        op["parameters"] = params
    if spec.body is not None:
        op["requestBody"] = {"required": spec.body_required, "content": {
            "application/json": {"schema": _model_ref(spec.body, schemas)}}}
    return op


def _model_ref(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def openapi_document(routes: list[BaseRoute], version: str) -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": ERROR_SCHEMA}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route):
            continue
        path = _PATH_PARAM.sub(r"{\1}", route.path)
        for method in sorted((route.methods or set()) - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = _operation(route, method.lower(), schemas)
    return {
        "openapi": "3.1.0",
        "info": {"title": "aenv control plane (E2B-compatible)", "version": version},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"ApiKey": {"type": "apiKey", "in": "header",
                                           "name": "X-API-Key"}},
        },
        "security": [{"ApiKey": []}],
        "paths": paths,
    }
