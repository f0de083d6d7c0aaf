"""The gateway's batch-job endpoints: `POST /v1/jobs`, `GET /v1/jobs/{id}`,
`GET /v1/jobs/{id}/results` (JSONL) and `POST /v1/jobs/{id}/cancel`.

Jobs are stored by `shoal.jobs.JobStore` and run by Celery workers (jobs/tasks.py), which send
each request back through this gateway with batch priority; the gateway only validates, stores
and enqueues (docs/jobs.md). OpenAI's Batch API makes jobs too (gateway/batches.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from shoal.jobs import JOBS_TTL_S, TASK_RUN_JOB, JobError, JobStore, make_celery, parse_lines


class JobStatus(BaseModel):
    id: str
    object: str
    status: str
    request_counts: dict[str, int]
    created_at: float | None
    started_at: float | None
    finished_at: float | None
    cancelled_at: float | None
    expires_at: float | None = None  # once finished: when its status and results go


class Jobs:
    """The jobs a gateway makes and reads: their store in the fleet's Redis (a synchronous
    client, connected at first use; the routes call it from a thread) and Celery's app, which
    the new jobs are sent to.

    Args:
        redis_url, prefix: the fleet's Redis and key prefix (jobs live beside the fleet's keys).
        request_models: each endpoint's name (`shoal.jobs.ENDPOINTS`) -> the pydantic model
            that validates a body.
        error: builds the gateway's error (message, status=, param=, kind=).
    """

    def __init__(self, redis_url: str, prefix: str, request_models: dict[str, type[BaseModel]],
                 error: Callable[..., Exception]) -> None:
        self.redis_url, self.prefix = redis_url, prefix
        self.request_models, self.error = request_models, error
        self._store: JobStore | None = None
        self._celery: Any = None

    @property
    def store(self) -> JobStore:
        if self._store is None:
            self._store = JobStore(redis.Redis.from_url(self.redis_url), self.prefix)
            self._celery = make_celery(self.redis_url, self.prefix)
        return self._store

    def parse(self, raw: str) -> list[dict[str, Any]]:
        """A job's input lines (`shoal.jobs.parse_lines`), every body validated as its
        endpoint's request.

        Raises:
            the gateway's error: 400 naming the line and the parameter.
        """
        try:
            items = parse_lines(raw)
        except JobError as e:
            raise self.error(str(e)) from e
        for n, item in enumerate(items, 1):
            try:
                self.request_models[item["endpoint"]].model_validate(item["body"])
            except ValidationError as e:
                first = e.errors()[0]
                where = ".".join(str(x) for x in first["loc"])
                raise self.error(f"request {n} ({item['custom_id']}): {where}: {first['msg']}",
                                 param=where) from e
        return items

    def create(self, items: list[dict[str, Any]], ttl_s: int = JOBS_TTL_S,
               meta: dict[str, str] | None = None) -> str:
        """Store a job of `items` (`JobStore.create`) and send it to the Celery workers; its id
        (blocking)."""
        job_id = self.store.create(items, ttl_s, meta)
        self._celery.send_task(TASK_RUN_JOB, args=[job_id])
        return job_id

    async def status(self, job_id: str) -> dict[str, Any]:
        """The job's status (`JobStore.status`).

        Raises:
            the gateway's error: 404 when there is no such job.
        """
        status = await asyncio.to_thread(lambda: self.store.status(job_id))
        if status is None:
            raise self.error(f"no job {job_id!r}", status=404, kind="not_found_error")
        return status


def jobs_router(jobs: Jobs, errors: Callable[..., dict]) -> APIRouter:
    """The job routes; `errors` gives the OpenAPI `responses` of a list of error statuses."""
    router = APIRouter()

    @router.post("/v1/jobs", status_code=202, response_model=JobStatus,
                 responses=errors(400, 401, 413))
    async def submit(request: Request):
        """A job: a JSON list or JSONL of completion, chat or response requests, each with a
        custom_id."""
        items = jobs.parse((await request.body()).decode("utf-8", errors="replace"))
        job_id = await asyncio.to_thread(jobs.create, items)
        return JSONResponse(await jobs.status(job_id), status_code=202)

    @router.get("/v1/jobs/{job_id}", response_model=JobStatus, responses=errors(401, 404))
    async def status(job_id: str):
        return await jobs.status(job_id)

    @router.get("/v1/jobs/{job_id}/results", responses=errors(401, 404))
    async def results(job_id: str):
        """One JSON line per finished request, in input order."""
        await jobs.status(job_id)
        lines = await asyncio.to_thread(lambda: jobs.store.results(job_id))
        return Response("".join(f"{line}\n" for line in lines), media_type="application/jsonl")

    @router.post("/v1/jobs/{job_id}/cancel", response_model=JobStatus, responses=errors(401, 404))
    async def cancel(job_id: str):
        """Requests not yet started will not run; running ones finish and are counted."""
        await jobs.status(job_id)
        await asyncio.to_thread(lambda: jobs.store.cancel(job_id))
        return await jobs.status(job_id)

    return router
