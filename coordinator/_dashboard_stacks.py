"""The dashboard's stacks: a job page's "stacks" button takes a capture, and the page shows the
captures the job keeps (grouped, the odd ones first), also once its workers are gone.

`POST /api/jobs/{job_id}/stacks` takes a capture (the one action of the dashboard besides its
login: same origin only, and like all of `/api/` it needs the session or the token, sent in a
header no other origin can set); `GET /api/jobs/{job_id}/stacks` reads what the job keeps.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from client.stacks import StackCapture
from coordinator._cluster import JobNotFound
from coordinator._cluster_stacks import JobNotRunning
from coordinator._errors import RequestError

if TYPE_CHECKING:
    from coordinator._service import CoordinatorService

__all__ = ["add_stack_routes"]

DASHBOARD_REASON = "requested from the dashboard"


def _capture_json(c: StackCapture) -> dict[str, Any]:
    return dataclasses.asdict(c)


def _answer(status: int, data: Any) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps(data, allow_nan=False),
        content_type="application/json",
        charset="utf-8",
    )


def add_stack_routes(
    router: web.UrlDispatcher,
    svc: CoordinatorService,
    job_id_of: Callable[[web.Request], str],
    written: Callable[[list[str]], Awaitable[None]],
    same_origin: Callable[[web.Request], bool],
) -> None:
    """Add the two stack routes; `job_id_of` answers 404 for a job the coordinator does not
    hold, `written` waits until the job's state is on disk."""

    async def take(request: web.Request) -> web.Response:
        if not same_origin(request):
            return _answer(403, {"error": "cross-origin request refused"})
        job_id = job_id_of(request)
        try:
            capture = await svc.capture_stacks(job_id, DASHBOARD_REASON)
        except JobNotRunning as exc:
            return _answer(409, {"error": str(exc)})
        except JobNotFound:
            return _answer(404, {"error": "no such job"})
        except RequestError as exc:
            return _answer(503, {"error": exc.message})
        return _answer(200, _capture_json(capture))

    async def kept(request: web.Request) -> web.Response:
        job_id = job_id_of(request)
        await written([job_id])
        captures = svc.cluster.job_stacks(job_id)
        return _answer(200, {"captures": [_capture_json(c) for c in captures]})

    router.add_post("/api/jobs/{job_id}/stacks", take)
    router.add_get("/api/jobs/{job_id}/stacks", kept)
