"""GET /: the chat playground, a static page shipped in the package (no CDN: the page
must work on an offline machine). Its assets are served under /static/."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

router = APIRouter()


@router.get("/", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


def static_files() -> StaticFiles:
    return StaticFiles(directory=STATIC_DIR)
