"""The Celery tasks of shoal's batch jobs (the app: `shoal.jobs.make_celery`).

A Celery worker runs them (`shoal jobs worker`, or `celery -A jobs.tasks worker`); each request
goes through the gateway's OpenAI API like any client's, with batch priority, so jobs and
interactive traffic share one fleet and one scheduler.

- `generate(request)`: one completion or chat request (chat when it has `messages`); returns the
  OpenAI-style response. For your own Celery code: `generate.delay({...}).get()`.
- `run_job(job_id)`: queues one `run_job_request` per request of a stored job.
- `run_job_request(job_id, index)`: runs one request of a job and records its output line, at
  most once per `custom_id` (shoal/jobs.py); a worker that starts queues again the unfinished
  requests of every queued or running job (`requeue_unfinished`). A request the fleet could not serve (it is
  unreachable, overloaded, or a worker died under the request more often than the scheduler's
  migration limit) is retried with backoff; a request the gateway rejects (4xx) is recorded as
  failed. Requests start only while the job is not cancelled.

Configuration, from the environment of the Celery worker (and of code calling the tasks):
`SHOAL_REDIS_URL` (broker, results and jobs; default redis://127.0.0.1:6379/0), `SHOAL_PREFIX`
(default shoal), `SHOAL_GATEWAY_URL` (default http://127.0.0.1:8000), `SHOAL_API_KEY`.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import httpx
import redis
from celery.signals import worker_ready

from jobs import metrics
from shoal import metrics as shoal_metrics
from shoal.jobs import (
    JOB_PRIORITY,
    PATHS,
    TASK_GENERATE,
    TASK_RUN_JOB,
    TASK_RUN_JOB_REQUEST,
    JobStore,
    endpoint_of,
    make_celery,
)

REDIS_URL = os.environ.get("SHOAL_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("SHOAL_PREFIX", "shoal")
app = make_celery(REDIS_URL, PREFIX)

MAX_RETRIES = 5
REQUEST_TIMEOUT_S = 600.0


class FleetUnavailable(Exception):
    """The fleet could not serve the request now (connection error, 429 or 5xx): retry."""


class RequestRejected(Exception):
    """The gateway rejected the request (4xx): retrying cannot help."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("error", {}).get("message", f"HTTP {status}"))
        self.status, self.body = status, body


@functools.cache  # one Redis connection pool per Celery worker process, not one per task
def _store() -> JobStore:
    return JobStore(redis.Redis.from_url(REDIS_URL), PREFIX)


def call_fleet(endpoint: str, body: dict[str, Any], priority: int) -> dict[str, Any]:
    """POST one request to the gateway and return its JSON response.

    Args:
        endpoint: "completions", "chat" or "responses" (`shoal.jobs.ENDPOINTS`).
        body: the OpenAI request body (not streamed).
        priority: the scheduler priority (lower first).

    Raises:
        FleetUnavailable: no answer, 429 or 5xx.
        RequestRejected: another 4xx.
    """
    url = os.environ.get("SHOAL_GATEWAY_URL", "http://127.0.0.1:8000").rstrip("/")
    path = PATHS[endpoint]
    key = os.environ.get("SHOAL_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.post(url + path, json={**body, "stream": False, "priority": priority},
                       headers=headers, timeout=REQUEST_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise FleetUnavailable(f"{url}: {e}") from e
    if r.status_code == 429 or r.status_code >= 500:
        raise FleetUnavailable(f"{url}{path}: HTTP {r.status_code}: {r.text[:200]}")
    if r.status_code >= 400:
        raise RequestRejected(r.status_code, r.json())
    return r.json()


@app.task(name=TASK_GENERATE, bind=True, max_retries=MAX_RETRIES)
def generate(self, request: dict[str, Any], priority: int = JOB_PRIORITY) -> dict[str, Any]:
    """One completion or chat request through the fleet; the OpenAI-style response.

    Raises:
        RequestRejected: the gateway rejected it (4xx).
        FleetUnavailable: still unavailable after MAX_RETRIES retries.
    """
    endpoint = endpoint_of(request)
    try:
        return call_fleet(endpoint, request, priority)
    except FleetUnavailable as e:
        raise self.retry(exc=e, countdown=min(2 ** self.request.retries, 30)) from e


@app.task(name=TASK_RUN_JOB)
def run_job(job_id: str) -> int:
    """Queue every request of a job (once; a redelivered run only queues again, which the
    per-request tasks absorb). Returns the number of requests."""
    store = _store()
    n = store.num_requests(job_id)
    for index in range(n):
        run_job_request.apply_async((job_id, index))
    return n


def serve_metrics(port: int) -> None:
    """Export this worker's metrics (jobs/metrics.py) on `port` (0: off); the number of open
    jobs is read from Redis at each scrape (NaN while Redis does not answer)."""
    def jobs_open() -> float:
        try:
            return float(_store().num_open())
        except redis.RedisError:
            return float("nan")
    metrics.JOBS_OPEN.set_function(jobs_open)
    shoal_metrics.serve_metrics(port)


@worker_ready.connect
def requeue_unfinished(**_: Any) -> None:
    """Queue again, as this worker starts, every request of a queued or running job that has no
    result: one whose task a killed worker took along would otherwise never run (shoal/jobs.py).
    Copies of requests whose tasks are still queued, or restored after the visibility timeout,
    find the result recorded and return at once; a copy that starts while its original runs
    (a job sent as this worker started) runs too, and only one of the two is recorded."""
    for job_id, missing in _store().unfinished().items():
        for index in missing:
            run_job_request.apply_async((job_id, index))


@app.task(name=TASK_RUN_JOB_REQUEST, bind=True, max_retries=MAX_RETRIES)
def run_job_request(self, job_id: str, index: int) -> str:
    """Run request `index` of a job and record its output line; returns what happened
    (`jobs.metrics.JOB_REQUESTS`' outcomes: a copy that ran while another recorded the same
    request first is a duplicate too)."""
    store = _store()
    item = store.request(job_id, index)
    cid = item["custom_id"]
    line: dict[str, Any] = {"id": f"{job_id}-{index}", "custom_id": cid, "response": None,
                            "error": None}
    if store.has_result(job_id, cid):
        outcome = "duplicate"
    elif store.start(job_id) == "cancelled":
        line["error"] = {"code": "cancelled", "message": "the job was cancelled first"}
        outcome = "cancelled"
    else:
        t0 = time.perf_counter()
        try:
            body = call_fleet(item["endpoint"], item["body"], JOB_PRIORITY)
        except FleetUnavailable as e:
            if self.request.retries < self.max_retries:
                metrics.JOB_REQUESTS.labels("retried").inc()
                raise self.retry(exc=e, countdown=min(2 ** self.request.retries, 30)) from e
            line["error"] = {"code": "fleet_unavailable", "message": str(e)}
            outcome = "failed"
        except RequestRejected as e:
            line["response"] = {"status_code": e.status, "body": e.body}
            line["error"] = {"code": "rejected", "message": str(e)}
            outcome = "failed"
        else:
            metrics.JOB_REQUEST_SECONDS.observe(time.perf_counter() - t0)
            line["response"] = {"status_code": 200, "body": body}
            outcome = "completed"
    if outcome != "duplicate" and not store.record(job_id, cid, line, outcome):
        outcome = "duplicate"
    metrics.JOB_REQUESTS.labels(outcome).inc()
    return outcome
