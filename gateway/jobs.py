"""The gateway's batch-job endpoints: `POST /v1/jobs`, `GET /v1/jobs/{id}`,
`GET /v1/jobs/{id}/results` (JSONL) and `POST /v1/jobs/{id}/cancel`.

Jobs are stored by `shoal.jobs.JobStore` and run by Celery workers (jobs/tasks.py), which send
each request back through this gateway with batch priority; the gateway only validates, stores
and enqueues (docs/jobs.md).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from shoal.jobs import TASK_RUN_JOB, JobError, JobStore, make_celery, parse_lines


class JobStatus(BaseModel):
    id: str
    object: str
    status: str
    request_counts: dict[str, int]
    created_at: float | None
    started_at: float | None
    finished_at: float | None
    cancelled_at: float | None


def jobs_router(redis_url: str, prefix: str, request_models: dict[str, type[BaseModel]],
                error: Callable[..., Exception], errors: Callable[..., dict]) -> APIRouter:
    """The job routes.

    Args:
        redis_url, prefix: the fleet's Redis and key prefix (jobs live beside the fleet's keys).
        request_models: each endpoint's name (`shoal.jobs.ENDPOINTS`) -> the pydantic model
            that validates a body.
        error: builds the gateway's OpenAI-style error (message, status=, param=, kind=).
        errors: the OpenAPI `responses` for a list of error statuses.
    """
    router = APIRouter()
    state: dict[str, Any] = {}

    def store() -> JobStore:
        if "store" not in state:
            state["store"] = JobStore(redis.Redis.from_url(redis_url), prefix)
            state["celery"] = make_celery(redis_url, prefix)
        return state["store"]

    def create(items: list[dict]) -> str:
        job_id = store().create(items)
        state["celery"].send_task(TASK_RUN_JOB, args=[job_id])
        return job_id

    async def known(job_id: str) -> dict:
        status = await asyncio.to_thread(lambda: store().status(job_id))
        if status is None:
            raise error(f"no job {job_id!r}", status=404, kind="not_found_error")
        return status

    @router.post("/v1/jobs", status_code=202, response_model=JobStatus,
                 responses=errors(400, 401, 413))
    async def submit(request: Request):
        """A job: a JSON list or JSONL of completion, chat or response requests, each with a
        custom_id."""
        raw = (await request.body()).decode("utf-8", errors="replace")
        try:
            items = parse_lines(raw)
        except JobError as e:
            raise error(str(e)) from e
        for n, item in enumerate(items, 1):
            try:
                request_models[item["endpoint"]].model_validate(item["body"])
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                raise error(f"request {n} ({item['custom_id']}): {where}: {first['msg']}",
                            param=where) from e
        job_id = await asyncio.to_thread(create, items)
        return JSONResponse(await known(job_id), status_code=202)

    @router.get("/v1/jobs/{job_id}", response_model=JobStatus, responses=errors(401, 404))
    async def status(job_id: str):
        return await known(job_id)

    @router.get("/v1/jobs/{job_id}/results", responses=errors(401, 404))
    async def results(job_id: str):
        """One JSON line per finished request, in input order."""
        await known(job_id)
        lines = await asyncio.to_thread(lambda: store().results(job_id))
        return Response("".join(f"{line}\n" for line in lines), media_type="application/jsonl")

    @router.post("/v1/jobs/{job_id}/cancel", response_model=JobStatus, responses=errors(401, 404))
    async def cancel(job_id: str):
        """Requests not yet started will not run; running ones finish and are counted."""
        await known(job_id)
        await asyncio.to_thread(lambda: store().cancel(job_id))
        return await known(job_id)

    return router
