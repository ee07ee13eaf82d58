"""The playground page: ``GET /`` serves ``static/index.html``, ``GET /static/...`` its scripts
(``playground.js``, the chat page; ``kv_view.js``, the KV cache view) and style sheet, all shipped in the
package (no build step, no CDN: it works offline). The page chats or completes over ``/v1/ws`` and draws
the KV block pool live from the same socket's ``subscribe_kv_cache``.

The page and its files hold no data, so they are public even with ``--api-key``; the page asks for the
key, keeps it in the browser's session storage, sends it as a bearer token over HTTP and in a first
``auth`` message over the websocket (a browser websocket cannot set headers).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).parents[1] / "static"
STATIC_PREFIX = "/static/"
#: the page runs only its own script and style, and talks only to its own origin
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def is_static_path(path: str) -> bool:
    """Whether ``path`` is one of the page's public files (``/static/...``)."""
    return path.startswith(STATIC_PREFIX)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(
        STATIC_DIR / "index.html",
        headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY, "Cache-Control": "no-cache"},
    )


def static_file(files: dict):
    """The handler of ``GET /static/{name}``: one of ``files`` (``{name: path}``, listed once at start:
    no path from the client reaches the file system), else a 404 that the middleware answers as JSON."""

    async def handler(request: web.Request) -> web.FileResponse:
        path = files.get(request.match_info["name"])
        if path is None:
            raise web.HTTPNotFound(text=f"no file {request.path}")
        return web.FileResponse(path, headers={"Cache-Control": "no-cache"})

    return handler


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", index)
    files = {p.name: p for p in STATIC_DIR.iterdir() if p.is_file()}
    app.router.add_get(STATIC_PREFIX + "{name:.+}", static_file(files))
