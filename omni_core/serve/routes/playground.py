"""The playground: a single page at ``/`` and ``/playground`` (plus its script and style) that drives the API
from a browser -- live step previews over the streamed image generation, Stop, history (docs/playground.md).

The files are static (``omni_core/serve/playground/``, shipped as package data; no build step, no CDN) and
public: the page needs no API key, the API calls it makes carry the key the user types."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

#: the page's files, served by name only (nothing else under the folder is reachable)
ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "style.css": "text/css; charset=utf-8"}
FOLDER = Path(__file__).resolve().parent.parent / "playground"
#: paths the API key does not guard (``middleware.AuthMiddleware``)
PAGE_PATHS = frozenset({"/", "/playground", "/playground/", *(f"/playground/{name}" for name in ASSETS)})

router = APIRouter(include_in_schema=False)


def _file(name: str) -> FileResponse:
    # no-cache: a browser revalidates (ETag), so a new version of the page is picked up at once
    return FileResponse(FOLDER / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.api_route("/", methods=["GET", "HEAD"])
@router.api_route("/playground", methods=["GET", "HEAD"])
@router.api_route("/playground/", methods=["GET", "HEAD"])
async def page():
    return _file("index.html")


@router.api_route("/playground/app.js", methods=["GET", "HEAD"])
async def script():
    return _file("app.js")


@router.api_route("/playground/style.css", methods=["GET", "HEAD"])
async def style():
    return _file("style.css")
