"""Assemble the server: store + runtime driver + manager + control-plane routes + proxy.

`build_server(config)` returns the ASGI application. Request flow:
  EdgeRouter -> sandbox traffic?  SandboxProxy (envd token checked by envd itself)
             -> otherwise         ApiKeyAuth -> Starlette control-plane routes
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import aenv
from aenv.api.bodies import InputLimits
from aenv.api.errors import CrashAnswer, error_response, from_aenv_error
from aenv.api.images import ImageRoutes
from aenv.api.openapi import openapi_document
from aenv.api.prom import CONTENT_TYPE, NodeMetrics
from aenv.api.proxy import SandboxProxy, route_by_headers, route_by_signature
from aenv.api.routes import SandboxRoutes
from aenv.api.templates import TemplateRoutes
from aenv.api.upgrade import TunnelRegistry
from aenv.api.volumes import CONTENT_PREFIX, VolumeRoutes
from aenv.builds.builder import TemplateBuilds
from aenv.builds.code_interpreter import CodeInterpreterTemplate
from aenv.config import Config
from aenv.errors import AenvError
from aenv.images.base import build_base_layer
from aenv.images.cache import LayerCache
from aenv.images.lazy import LazyLayers
from aenv.images.pull import ImagePuller
from aenv.orchestrator.events import SandboxEvents
from aenv.orchestrator.manager import SandboxManager
from aenv.orchestrator.models import TemplateRecord
from aenv.orchestrator.samples import MetricSamples
from aenv.orchestrator.store import Store
from aenv.orchestrator.volumes import VolumeManager
from aenv.runtime.registry import load_driver
from aenv.storage.layout import Layout
from aenv.storage.repository import LocalCache, Repository, open_blob_store
from aenv.storage.volume import attach_storage

log = logging.getLogger("aenv.api")

UNAUTHENTICATED_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})


class ApiKeyAuth:
    """Checks `X-API-Key` on every control-plane route except health and metrics."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The volume content API checks each volume's own token instead (api/volumes.py).
        if (scope["type"] == "http" and scope["path"] not in UNAUTHENTICATED_PATHS
                and not scope["path"].startswith(CONTENT_PREFIX)):
            given = next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
            if not hmac.compare_digest(given, self.api_key):
                message = "missing API key" if not given else "invalid API key"
                await error_response(401, f"{message}: send X-API-Key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class EdgeRouter:
    """Sends sandbox traffic to the proxy and everything else to the control plane.
    Upgrade requests (WebSocket, ...) to sandbox ports never reach it as ASGI requests:
    uvicorn's protocol (`api/upgrade.py`) hands them to `tunnels` before that."""

    def __init__(self, control: ASGIApp, proxy: SandboxProxy, domain: str | None,
                 tunnels: TunnelRegistry) -> None:
        self.control = control
        self.proxy = proxy
        self.domain = domain
        self.tunnels = tunnels

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            target = route_by_headers(scope, self.domain) or (
                route_by_signature(scope, self.proxy.access_tokens) if scope["type"] == "http"
                else None)
            if target is not None:
                await self.proxy(scope, receive, send, target)
                return
        await self.control(scope, receive, send)


@dataclass
class Server:
    app: ASGIApp
    manager: SandboxManager
    api_key: str


def base_template(config: Config, layer_id: str) -> TemplateRecord:
    s = config.sandbox
    return TemplateRecord(template_id="base", names=["base"], layers=[layer_id],
                          cpu_count=s.cpu_count, memory_mb=s.memory_mb,
                          disk_size_mb=s.disk_size_mb, default_user=s.default_user)


def build_server(config: Config, show_progress: bool = True) -> Server:
    config.snapshot.validate()
    layout = Layout(config.home)
    # The volume first: after a reboot the home's storage directories are symlinks into
    # its (not yet mounted) mount point.
    layout.ensure_home()
    st = config.storage
    attach_storage(config.home, st.volume, st.volume_size_gb, st.volume_image)
    layout.ensure()
    api_key = config.server.api_key or layout.api_key()
    store = Store(layout.database)
    driver = load_driver(config.runtime.driver, config)

    async def ensure_templates() -> None:
        layer = await asyncio.to_thread(build_base_layer, layout.layers_dir, layout.cache_dir,
                                        show_progress)
        wanted = base_template(config, layer.name)
        current = store.find_template("base")
        if current is None or current.layers != wanted.layers:
            store.put_template(wanted)

    repository = Repository(open_blob_store(config.snapshot, config.home))
    snapshots = LocalCache(layout.cache_dir / "snapshots", config.snapshot.cache_bytes, repository)
    # The image layer cache never evicts what the manager's sandboxes use (asked at each pass).
    img = config.images
    lazy = (LazyLayers(layout, repository, img.on_demand_prefetch_s
                       if img.on_demand_prefetch_s >= 0 else None)
            if img.on_demand or img.convert_layers else None)
    layer_cache = LayerCache(layout.layers_dir, layout.cache_dir / "oci-layers.json",
                             img.cache_bytes, in_use=lambda: manager.layers_in_use(), lazy=lazy)
    puller = ImagePuller(config, layout, store, layer_cache, lazy)
    puller.sweep()
    sc = config.sandbox
    events = SandboxEvents(layout.home / "events.sqlite3", max_per_sandbox=sc.logs_per_sandbox,
                           max_age_s=sc.logs_max_age_s)
    events.prune()
    manager = SandboxManager(config, layout, store, driver, ensure_templates, snapshots,
                             load_driver=lambda name: load_driver(name, config), images=puller,
                             events=events)
    samples = MetricSamples(manager, sc.metrics_interval_s, sc.metrics_kept)
    node_metrics = NodeMetrics(manager, layer_cache, events)
    proxy = SandboxProxy(manager)
    routes = SandboxRoutes(manager, config, samples)
    images = ImageRoutes(puller, store)
    builds = TemplateBuilds(config, layout, manager, puller)
    code_interpreter = CodeInterpreterTemplate(builds)
    manager.template_provider = code_interpreter.ensure
    templates = TemplateRoutes(builds)
    volumes = VolumeManager(layout.volumes_dir, config.storage.volumes_size_mb,
                            config.storage.volumes_max, users=manager.volume_users)
    volumes.load()
    manager.volumes = volumes
    volume_routes = VolumeRoutes(volumes, manager, config)

    async def health(_: Request) -> Response:
        return Response(status_code=204)

    async def on_aenv_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, AenvError)
        response = from_aenv_error(exc)
        node_metrics.count_error(exc.code, response.status_code)
        return response

    async def metrics(_: Request) -> Response:
        return Response(node_metrics.exposition(), media_type=CONTENT_TYPE)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(exc.status_code, str(exc.detail))

    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await manager.start()
        sampler = asyncio.create_task(samples.run(), name="aenv-metric-samples")
        prebuild = (asyncio.create_task(code_interpreter.prebuild(), name="aenv-ci-prebuild")
                    if config.sandbox.code_interpreter_prebuild else None)
        try:
            yield
        finally:
            if prebuild is not None:
                prebuild.cancel()
                await asyncio.gather(prebuild, return_exceptions=True)
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
            await builds.close()
            await manager.close()
            await puller.close()
            store.close()
            events.close()

    async def openapi(_: Request) -> Response:
        return JSONResponse(openapi_document(control.routes, aenv.__version__))

    control = Starlette(
        routes=[Route("/health", health, methods=["GET"]),
                Route("/openapi.json", openapi, methods=["GET"]),
                Route("/metrics", metrics, methods=["GET"]), *routes.routes(),
                *images.routes(), *templates.routes(), *volume_routes.routes()],
        middleware=[Middleware(CrashAnswer)],
        exception_handlers={AenvError: on_aenv_error, HTTPException: on_http_error,
                            Exception: on_crash},
        lifespan=lifespan,
    )
    control.state.input_limits = InputLimits.from_config(config.server)
    app = EdgeRouter(ApiKeyAuth(control, api_key), proxy, config.server.domain,
                     TunnelRegistry(manager))
    return Server(app=app, manager=manager, api_key=api_key)
