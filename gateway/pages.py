"""The gateway's browser pages: a playground (`GET /`) and a live fleet view (`GET /fleet`), plus
the JSON the fleet view polls (`GET /v1/fleet`).

The pages are static HTML files in gateway/static/ with inline JavaScript and one shared
stylesheet (`shoal.css`), and no front-end dependencies: nothing to build, nothing fetched from
elsewhere. The playground streams
over the WebSocket `/v1/stream` (the API key, if any, goes in its `api_key` query parameter,
because browsers cannot set headers on a WebSocket); the fleet view polls `/v1/fleet` every second
with the key as a Bearer token. The key lives in the page's sessionStorage only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

STATIC = Path(__file__).parent / "static"


def pages_router(fleet: Callable[[], Awaitable[Any]], fleet_model: type,
                 errors: Callable[..., dict]) -> APIRouter:
    """Routes of the pages.

    Args:
        fleet: returns the fleet's state (a `fleet_model` instance) read from Redis.
        fleet_model: the pydantic model of `GET /v1/fleet` (for the OpenAPI schema).
        errors: the gateway's OpenAPI error documentation helper.
    """
    router = APIRouter()

    def static(name: str, media_type: str = "text/html") -> Response:
        # Read per request: the files are small and an edited page shows without a restart.
        return Response((STATIC / name).read_text(encoding="utf-8"), media_type=media_type)

    # In the schema: POST / (TGI's API) is, and a path's methods are documented together.
    @router.get("/", response_class=HTMLResponse)
    async def playground():
        """The playground page."""
        return static("playground.html")

    @router.get("/fleet", response_class=HTMLResponse, include_in_schema=False)
    async def fleet_page():
        return static("fleet.html")

    @router.get("/shoal.css", include_in_schema=False)
    async def stylesheet():
        return static("shoal.css", "text/css")

    @router.get("/v1/fleet", response_model=fleet_model, responses=errors(401, 503))
    async def fleet_status():
        return await fleet()

    return router
