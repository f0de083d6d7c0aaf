"""Batch jobs: their state in Redis and the Celery app that runs them, shared by the gateway (which
creates, reads and cancels jobs) and the Celery worker (jobs/tasks.py, which runs them).

A job is a list of completion or chat requests, each with a `custom_id`. Its state, under the
fleet's key prefix (`Keys.job*`):

- `job:{id}` hash: `status` (queued, running, completed, failed, cancelled), `total`,
  `completed`, `failed`, `cancelled` (requests that will never run), Unix timestamps
  `created_at`, `started_at`, `finished_at`, `cancelled_at`, `ttl_s` (below) and the fields of
  whoever made the job as `meta:{name}` (a batch's input file, endpoint and metadata);
- `job:{id}:requests` list: the input lines (JSON), in input order;
- `jobs:open` set: the ids of the queued and running jobs (a job leaves it in the same script
  that makes it finished or cancelled), so a starting Celery worker reads only those;
- `job:{id}:results` hash: `custom_id` -> output line (JSON). Written once per `custom_id`
  (HSETNX) together with its count, in one Lua script, so a task run twice (a redelivery after a
  Celery worker died) neither duplicates a result nor counts it twice.

A job finishes when every request has a result: `completed` if any request succeeded, `failed`
if none did, and `cancelled` stays `cancelled`. The script that finishes it also sets its three
keys to expire `ttl_s` seconds later (`JOBS_TTL_S`, 30 days, unless its maker chose: a batch's
`output_expires_after`), as OpenAI keeps a batch's output files: without it every job ever run
would stay in Redis.

Celery uses the same Redis with its own key prefix (`{prefix}:celery:`): tasks acknowledge late
(after they ran), and a task whose worker died is delivered again once the broker's visibility
timeout has passed (`SHOAL_JOBS_VISIBILITY_TIMEOUT`, seconds, default 300), found by a sweep every
quarter of that timeout. A task can still be lost: kombu pops a message from the queue before it
records it as unacknowledged, and a worker killed between the two takes it along. So a Celery
worker that starts queues again every unfinished request of the queued and running jobs
(`JobStore.unfinished`); a copy whose request has its result by then returns at once.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import redis

from shoal.keys import Keys

TASK_RUN_JOB = "shoal.run_job"
TASK_RUN_JOB_REQUEST = "shoal.run_job_request"
TASK_GENERATE = "shoal.generate"
JOB_PRIORITY = 1  # batch requests yield to interactive ones (priority 0) in the scheduler
TERMINAL = ("completed", "failed", "cancelled")
JOBS_TTL_S = 30 * 86400  # how long a finished job is kept, in seconds
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
             "/v1/responses": "responses"}
PATHS = {name: path for path, name in ENDPOINTS.items()}


def endpoint_of(request: dict[str, Any]) -> str:
    """The endpoint a flat-form request is for, by its fields: chat with `messages`, the
    Responses API with `input`, else completions."""
    return "chat" if "messages" in request else "responses" if "input" in request \
        else "completions"

# Records one request's output line and its count, once per custom_id; finishes the job when
# every request has one, its keys then expiring after its ttl_s (ARGV[6] for a job made
# without one). KEYS: job hash, results hash, open-jobs set, requests list. ARGV: custom_id,
# line, counter, now, job id, default ttl.
_RECORD = """
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
local h = redis.call('HMGET', KEYS[1], 'total', 'completed', 'failed', 'cancelled', 'status',
                     'ttl_s')
local done = tonumber(h[2]) + tonumber(h[3]) + tonumber(h[4])
if done >= tonumber(h[1]) then
  if h[5] ~= 'cancelled' then
    redis.call('HSET', KEYS[1], 'status', tonumber(h[2]) > 0 and 'completed' or 'failed')
  end
  redis.call('HSET', KEYS[1], 'finished_at', ARGV[4])
  redis.call('SREM', KEYS[3], ARGV[5])
  local ttl = tonumber(h[6] or ARGV[6])
  for _, k in ipairs({KEYS[1], KEYS[2], KEYS[4]}) do redis.call('EXPIRE', k, ttl) end
end
return 1
"""

# queued -> running, once. KEYS: job hash. ARGV: now.
_START = """
if redis.call('HGET', KEYS[1], 'status') == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1])
end
return redis.call('HGET', KEYS[1], 'status')
"""

# queued/running -> cancelled. KEYS: job hash, open-jobs set. ARGV: now, job id. Returns the
# status after.
_CANCEL = """
local s = redis.call('HGET', KEYS[1], 'status')
if s == 'queued' or s == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'cancelled_at', ARGV[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  s = 'cancelled'
end
return s
"""


class JobError(ValueError):
    """A job's input cannot be accepted (the message says which line and why)."""


def parse_lines(body: str) -> list[dict[str, Any]]:
    """A job's input: a JSON list, or JSONL (one JSON object per line).

    Each item is either OpenAI's batch form `{"custom_id", "method": "POST", "url":
    "/v1/chat/completions", "body": {...}}` or the flat form `{"custom_id", ...request fields}`
    (`endpoint_of`). Returns `{"custom_id", "endpoint",
    "body"}` items in input order.

    Raises:
        JobError: not JSON, no items, a missing or repeated custom_id, an unknown url,
            `stream` or `background`.
    """
    text = body.strip()
    try:
        if text.startswith("["):
            items = json.loads(text)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise JobError(f"the job is neither a JSON list nor JSONL: {e}") from e
    if not isinstance(items, list) or not items:
        raise JobError("the job has no requests")
    out, seen = [], set()
    for n, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise JobError(f"request {n}: expected a JSON object")
        cid = item.get("custom_id")
        if not isinstance(cid, str) or not cid:
            raise JobError(f"request {n}: custom_id must be a non-empty string")
        if cid in seen:
            raise JobError(f"request {n}: custom_id {cid!r} is repeated")
        seen.add(cid)
        if "body" in item:
            endpoint = ENDPOINTS.get(item.get("url", ""))
            if endpoint is None:
                raise JobError(f"request {n}: url must be one of {sorted(ENDPOINTS)}")
            req = item["body"]
        else:
            req = {k: v for k, v in item.items() if k != "custom_id"}
            endpoint = endpoint_of(req)
        if not isinstance(req, dict):
            raise JobError(f"request {n}: body must be a JSON object")
        if req.get("stream"):
            raise JobError(f"request {n}: stream is not supported in a job")
        if req.get("background"):  # the job would record the queued response as the result
            raise JobError(f"request {n}: background is not supported in a job")
        out.append({"custom_id": cid, "endpoint": endpoint, "body": req})
    return out


class JobStore:
    """A job's state in Redis (layout in the module docstring). Synchronous redis-py; the
    gateway calls it from a thread.

    Args:
        client: a redis-py client of the fleet's Redis.
        prefix: the fleet's key prefix.
    """

    def __init__(self, client: redis.Redis, prefix: str = "shoal") -> None:
        self.r = client
        self.keys = Keys(prefix)
        self._record = client.register_script(_RECORD)
        self._start = client.register_script(_START)
        self._cancel = client.register_script(_CANCEL)

    def create(self, items: list[dict[str, Any]], ttl_s: int = JOBS_TTL_S,
               meta: dict[str, str] | None = None) -> str:
        """Store a new job (status `queued`) and return its id. It is kept `ttl_s` seconds
        once finished; `meta`: its maker's own fields (`metadata`)."""
        job_id = f"job-{uuid.uuid4().hex}"
        pipe = self.r.pipeline(transaction=True)
        pipe.rpush(self.keys.job_requests(job_id), *[json.dumps(i) for i in items])
        pipe.hset(self.keys.job(job_id), mapping={
            "status": "queued", "total": len(items), "completed": 0, "failed": 0,
            "cancelled": 0, "created_at": time.time(), "ttl_s": ttl_s,
            **{f"meta:{k}": v for k, v in (meta or {}).items()}})
        pipe.sadd(self.keys.jobs_open, job_id)
        pipe.execute()
        return job_id

    def metadata(self, job_id: str) -> dict[str, str]:
        """The `meta` the job was made with (empty for an unknown job)."""
        fields = self.r.hgetall(self.keys.job(job_id))
        return {k.decode()[5:]: v.decode() for k, v in fields.items()
                if k.startswith(b"meta:")}

    def status(self, job_id: str) -> dict[str, Any] | None:
        """The job's status object (as `GET /v1/jobs/{id}` returns it), or None if unknown."""
        h = {k.decode(): v.decode() for k, v in self.r.hgetall(self.keys.job(job_id)).items()}
        if not h:
            return None
        stamp = {k: float(h[k]) if k in h else None
                 for k in ("created_at", "started_at", "finished_at", "cancelled_at")}
        ttl_s = int(h.get("ttl_s", JOBS_TTL_S))
        return {"id": job_id, "object": "job", "status": h["status"],
                "request_counts": {k: int(h[k]) for k in ("total", "completed", "failed",
                                                          "cancelled")},
                **stamp, "expires_at": None if stamp["finished_at"] is None
                else stamp["finished_at"] + ttl_s}

    def request(self, job_id: str, index: int) -> dict[str, Any]:
        return json.loads(self.r.lindex(self.keys.job_requests(job_id), index))

    def num_requests(self, job_id: str) -> int:
        return self.r.llen(self.keys.job_requests(job_id))

    def has_result(self, job_id: str, custom_id: str) -> bool:
        return bool(self.r.hexists(self.keys.job_results(job_id), custom_id))

    def start(self, job_id: str) -> str:
        """Mark the job running (once); returns its status."""
        return self._start(keys=[self.keys.job(job_id)], args=[time.time()]).decode()

    def record(self, job_id: str, custom_id: str, line: dict[str, Any], counter: str) -> bool:
        """Store one request's output line and count it under `counter` (completed, failed or
        cancelled), once per custom_id. Returns False when it was recorded already."""
        keys = [self.keys.job(job_id), self.keys.job_results(job_id), self.keys.jobs_open,
                self.keys.job_requests(job_id)]
        return bool(self._record(keys=keys, args=[custom_id, json.dumps(line), counter,
                                                  time.time(), job_id, JOBS_TTL_S]))

    def cancel(self, job_id: str) -> str | None:
        """Cancel a queued or running job; requests not yet started will not run. Returns the
        status after (a finished job keeps its own), or None if unknown."""
        if not self.r.exists(self.keys.job(job_id)):
            return None
        return self._cancel(keys=[self.keys.job(job_id), self.keys.jobs_open],
                            args=[time.time(), job_id]).decode()

    def num_open(self) -> int:
        """How many jobs are queued or running."""
        return self.r.scard(self.keys.jobs_open)

    def unfinished(self) -> dict[str, list[int]]:
        """Every queued or running job's requests without a result yet (indexes), by job.

        Reads only the open jobs (`jobs:open`), in two pipelined round trips whatever their
        number: the jobs' input lines, then which of their custom_ids have a result.
        """
        job_ids = sorted(m.decode() for m in self.r.smembers(self.keys.jobs_open))
        if not job_ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.lrange(self.keys.job_requests(job_id), 0, -1)
        ids = [[json.loads(i)["custom_id"] for i in items] for items in pipe.execute()]
        for job_id, cids in zip(job_ids, ids):
            pipe.hmget(self.keys.job_results(job_id), cids or ["-"])
        found = pipe.execute()
        return {job_id: [k for k, f in enumerate(got[:len(cids)]) if f is None]
                for job_id, cids, got in zip(job_ids, ids, found)}

    def results(self, job_id: str) -> list[str]:
        """The output lines recorded so far, in input order (JSON strings)."""
        items = self.r.lrange(self.keys.job_requests(job_id), 0, -1)
        ids = [json.loads(i)["custom_id"] for i in items]
        found = self.r.hmget(self.keys.job_results(job_id), ids) if ids else []
        return [f.decode() for f in found if f is not None]


def make_celery(redis_url: str, prefix: str = "shoal"):
    """The Celery app of shoal's jobs: Redis as broker and result backend under
    `{prefix}:celery:`, late acknowledgement, one task prefetched at a time."""
    from celery import Celery

    keyprefix = f"{prefix}:celery:"
    visibility = int(os.environ.get("SHOAL_JOBS_VISIBILITY_TIMEOUT", "300"))
    app = Celery("shoal", broker=redis_url, backend=redis_url)
    app.conf.update(
        broker_transport_options={
            "global_keyprefix": keyprefix, "visibility_timeout": visibility,
            # kombu looks for unacknowledged tasks past their visibility timeout every interval x
            # throttle seconds, 10 x 10 by default: a dead worker's tasks came back up to 100 s
            # late (seen in tests/test_jobs.py). Sweep every quarter of the timeout instead.
            "unacked_restore_interval": max(1, visibility // 4), "unacked_restore_throttle": 1,
            # A worker killed inside a sweep leaves kombu's sweep lock held until it expires,
            # 300 s by default, and no one restores anything meanwhile. A sweep is a few Redis
            # commands (kombu's restore_visible), so the lock can lapse within one interval.
            "unacked_mutex_expire": max(1, visibility // 4)},
        result_backend_transport_options={"global_keyprefix": keyprefix},
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_serializer="json", result_serializer="json", accept_content=["json"],
        result_expires=7 * 24 * 3600,
        broker_connection_retry_on_startup=True,
    )
    return app
