"""`/docs` that works offline: Swagger UI from the `swagger-ui-bundle` package, served by this
server, instead of FastAPI's default page, which loads it from a CDN (a server without internet
access, the common case for a model server, showed a blank page). ReDoc, CDN-only, is off."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs/assets"


def add_offline_docs(app: FastAPI) -> None:
    """Serve Swagger UI for `app.openapi_url` at DOCS_PATH, its files under ASSETS_PATH (build the
    app with `docs_url=None`)."""
    assert app.openapi_url is not None, "the docs page reads the OpenAPI document"
    openapi_url = app.openapi_url

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{app.title} - API",
                                   swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS_PATH}/favicon-32x32.png")

    app.add_api_route(DOCS_PATH, docs, methods=["GET"], include_in_schema=False)
    app.mount(ASSETS_PATH, StaticFiles(directory=swagger_ui_path), name="docs-assets")
