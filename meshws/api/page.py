"""The chat page: `GET /` and `/static/*`, served from the `web/` files shipped with the package.

`web/` stays at the top of the repository; packaging maps it to `meshws.web`, so an
installed node (editable or not) finds it through `importlib.resources`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from aiohttp import web

PAGE_PACKAGE = "meshws.web"


def web_dir() -> Path | None:
    """The folder holding index.html, chat.js and chat.css; None when the package lacks it."""
    try:
        folder = Path(str(resources.files(PAGE_PACKAGE)))
    except (ModuleNotFoundError, TypeError):
        return None
    return folder if (folder / "index.html").is_file() else None


def add_page_routes(app: web.Application) -> bool:
    """Serve the chat page; False (and no routes) when it is not installed."""
    folder = web_dir()
    if folder is None:
        return False

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(folder / "index.html")

    app.router.add_get("/", index)
    app.router.add_static("/static/", folder)
    return True
