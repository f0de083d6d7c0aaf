"""OpenAI's Files and Batch APIs over shoal's batch jobs, so that OpenAI's clients run batches
unchanged: `POST /v1/files` (purpose "batch") keeps a JSONL file in Redis, and
`POST /v1/batches` makes a job of its lines (gateway/jobs.py), which the Celery workers run as
any job, behind interactive requests. A batch's status, counts and files are read from its job.

- A batch is its job: batch `batch_<hex>` is job `job-<hex>`, whose `meta` fields
  (`JobStore.metadata`) keep what the Batch API adds (the input file, the endpoint, the
  metadata).
- Its output and error files are its job's result lines without and with an `error`, under
  the ids `file-<hex>-output` and `file-<hex>-errors`: made when read, never stored twice.
- Uploads are kept `FILES_TTL_S` (30 days), or their `expires_after` seconds when they give
  them (OpenAI's: an hour to 30 days from its creation); deleting an input file does not stop a
  batch made from it. A batch and its output and error files are kept, as its job is, 30 days
  after it finishes, or its `output_expires_after` seconds (the same bounds). Uploads are
  bounded by the gateway's `--max-file-bytes` (100 MiB by default; OpenAI's own limit for
  batch input files is 200 MB).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from gateway.jobs import Jobs
from shoal.jobs import ENDPOINTS

FILES_PATH = "/v1/files"  # uploads: their own body limit
FILES_TTL_S = 30 * 86400
MIN_FILE_TTL_S = 3600  # the shortest `expires_after` OpenAI's API takes
COMPLETION_WINDOW = "24h"  # the only one OpenAI offers; the fleet runs a batch as it can


class ExpiresAfter(BaseModel):
    """When a batch's output and error files expire: `seconds` after they are made."""

    model_config = ConfigDict(strict=True)

    anchor: Literal["created_at"]
    seconds: int = Field(ge=MIN_FILE_TTL_S, le=FILES_TTL_S)


class BatchRequest(BaseModel):
    """`POST /v1/batches`."""

    model_config = ConfigDict(strict=True)

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = None


def _hex(object_id: str, prefix: str) -> str | None:
    return object_id[len(prefix):] if object_id.startswith(prefix) else None


def batches_router(jobs: Jobs, errors: Callable[..., dict], max_file_bytes: int) -> APIRouter:
    """The Files and Batch API routes over `jobs`; `errors` gives the OpenAPI `responses` of a
    list of error statuses; uploads of more than `max_file_bytes` get 413."""
    router = APIRouter()
    error = jobs.error

    def r():  # the fleet's Redis (synchronous: every call below runs in a thread)
        return jobs.store.r

    def keys():
        return jobs.store.keys

    # -- files ----------------------------------------------------------------------------------

    def file_object(file_id: str, size: int, created_at: float, filename: str,
                    purpose: str, ttl_s: int = FILES_TTL_S) -> dict[str, Any]:
        return {"id": file_id, "object": "file", "bytes": size, "created_at": int(created_at),
                "expires_at": int(created_at + ttl_s), "filename": filename,
                "purpose": purpose, "status": "processed"}

    def uploaded(file_id: str) -> tuple[dict[str, Any], bytes] | None:
        h = r().hgetall(keys().file(file_id))
        if not h:
            return None
        data = h[b"data"]
        return file_object(file_id, len(data), float(h[b"created_at"]),
                           h[b"filename"].decode(), h[b"purpose"].decode(),
                           int(h.get(b"ttl_s", FILES_TTL_S))), data

    def batch_file(file_id: str) -> tuple[dict[str, Any], bytes] | None:
        """A batch's output or error file, made from its job's results."""
        hex_ = _hex(file_id, "file-") or ""
        for suffix, errored in (("-output", False), ("-errors", True)):
            if not hex_.endswith(suffix):
                continue
            batch_hex = hex_.removesuffix(suffix)
            status = jobs.store.status("job-" + batch_hex)
            if status is None or status["finished_at"] is None:  # made when the batch ends
                return None
            lines = [line for line in jobs.store.results("job-" + batch_hex)
                     if (json.loads(line)["error"] is not None) == errored]
            data = "".join(f"{line}\n" for line in lines).encode()
            made = status["finished_at"]
            return file_object(file_id, len(data), made, f"batch_{batch_hex}{suffix}.jsonl",
                               "batch_output", round(status["expires_at"] - made)), data
        return None

    def find_file(file_id: str) -> tuple[dict[str, Any], bytes]:
        found = uploaded(file_id) or batch_file(file_id)
        if found is None:
            raise error(f"no file {file_id!r}", status=404, param="file_id",
                        kind="not_found_error")
        return found

    @router.post(FILES_PATH, responses=errors(400, 401, 413), max_body_size=max_file_bytes)
    async def upload(file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()],
                     anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
                     seconds: Annotated[int | None,
                                        Form(alias="expires_after[seconds]")] = None):
        """A file for a batch (`purpose` "batch"): JSONL of requests in OpenAI's batch form,
        kept `expires_after[seconds]` after its creation (30 days when not given)."""
        if purpose != "batch":
            raise error('purpose must be "batch" (files are kept for batches only)',
                        param="purpose")
        if (anchor is None) != (seconds is None) or anchor not in (None, "created_at"):
            raise error('expires_after needs anchor "created_at" and seconds',
                        param="expires_after")
        ttl_s = FILES_TTL_S if seconds is None else seconds
        if not MIN_FILE_TTL_S <= ttl_s <= FILES_TTL_S:
            raise error(f"expires_after.seconds must be in [{MIN_FILE_TTL_S}, {FILES_TTL_S}]",
                        param="expires_after")
        data = await file.read()
        file_id, now = f"file-{uuid.uuid4().hex}", time.time()

        def keep() -> None:
            pipe = r().pipeline(transaction=True)
            pipe.hset(keys().file(file_id), mapping={
                "data": data, "filename": file.filename or "upload.jsonl", "purpose": purpose,
                "created_at": now, "ttl_s": ttl_s})
            pipe.expire(keys().file(file_id), ttl_s)
            pipe.zadd(keys().files, {file_id: now})
            pipe.execute()
        await asyncio.to_thread(keep)
        return file_object(file_id, len(data), now, file.filename or "upload.jsonl", purpose,
                           ttl_s)

    @router.get("/v1/files", responses=errors(401))
    async def list_files():
        """The uploaded files still kept, oldest first."""
        def kept() -> list[dict[str, Any]]:
            ids = [m.decode() for m in r().zrange(keys().files, 0, -1)]
            found = [uploaded(i) for i in ids]
            gone = [i for i, f in zip(ids, found) if f is None]  # expired
            if gone:
                r().zrem(keys().files, *gone)
            return [f[0] for f in found if f is not None]
        return {"object": "list", "data": await asyncio.to_thread(kept), "has_more": False}

    @router.get("/v1/files/{file_id}", responses=errors(401, 404))
    async def get_file(file_id: str):
        return (await asyncio.to_thread(find_file, file_id))[0]

    @router.get("/v1/files/{file_id}/content", responses={
        200: {"content": {"application/octet-stream": {}}}, **errors(401, 404)})
    async def file_content(file_id: str):
        data = (await asyncio.to_thread(find_file, file_id))[1]
        return Response(data, media_type="application/octet-stream")

    @router.delete("/v1/files/{file_id}", responses=errors(401, 404))
    async def delete_file(file_id: str):
        def delete() -> bool:
            pipe = r().pipeline(transaction=True)
            pipe.delete(keys().file(file_id))
            pipe.zrem(keys().files, file_id)
            return bool(pipe.execute()[0])
        if not await asyncio.to_thread(delete):
            raise error(f"no uploaded file {file_id!r}", status=404, param="file_id",
                        kind="not_found_error")
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches --------------------------------------------------------------------------------

    def batch_object(batch_id: str) -> dict[str, Any] | None:
        """The batch, with its status and counts read from its job."""
        hex_ = _hex(batch_id, "batch_")
        h = jobs.store.metadata("job-" + hex_) if hex_ else {}
        job = jobs.store.status("job-" + hex_) if "endpoint" in h else None
        if job is None:
            return None
        counts = job["request_counts"]
        done = counts["completed"] + counts["failed"] + counts["cancelled"] == counts["total"]
        status = {"queued": "in_progress", "running": "in_progress", "completed": "completed",
                  "failed": "completed"}.get(job["status"],
                                             "cancelled" if done else "cancelling")
        ended = status in ("completed", "cancelled")
        created = int(job["created_at"])

        def stamp(key: str, when: bool) -> int | None:
            return int(job[key]) if when and job[key] is not None else None
        return {
            "id": batch_id, "object": "batch", "endpoint": h["endpoint"],
            "errors": None, "input_file_id": h["input_file_id"],
            "completion_window": COMPLETION_WINDOW, "status": status,
            "output_file_id": f"file-{hex_}-output" if ended and counts["completed"] else None,
            "error_file_id": f"file-{hex_}-errors"
            if ended and counts["failed"] + counts["cancelled"] else None,
            "created_at": created, "in_progress_at": created,
            "expires_at": created + 86400, "finalizing_at": stamp("finished_at", ended),
            "completed_at": stamp("finished_at", status == "completed"),
            "failed_at": None, "expired_at": None,
            "cancelling_at": stamp("cancelled_at", True),
            "cancelled_at": stamp("finished_at", status == "cancelled"),
            "request_counts": {"total": counts["total"], "completed": counts["completed"],
                               "failed": counts["failed"]},
            "metadata": json.loads(h["metadata"]) if h.get("metadata") else None,
        }

    def known(batch_id: str) -> dict[str, Any]:
        batch = batch_object(batch_id)
        if batch is None:
            raise error(f"no batch {batch_id!r}", status=404, param="batch_id",
                        kind="not_found_error")
        return batch

    @router.post("/v1/batches", responses=errors(400, 401, 404))
    async def create(req: BatchRequest):
        """A batch of the input file's requests, each of them for `endpoint`."""
        _, data = await asyncio.to_thread(find_file, req.input_file_id)
        items = jobs.parse(data.decode("utf-8", errors="replace"))
        wrong = [i["custom_id"] for i in items if i["endpoint"] != ENDPOINTS[req.endpoint]]
        if wrong:
            raise error(f"every request of a batch is for its endpoint {req.endpoint}: "
                        f"{wrong[0]!r} is not", param="endpoint")

        def make() -> str:
            kept = req.output_expires_after
            job_id = jobs.create(items, FILES_TTL_S if kept is None else kept.seconds, meta={
                "input_file_id": req.input_file_id, "endpoint": req.endpoint,
                "metadata": json.dumps(req.metadata) if req.metadata is not None else ""})
            batch_id = "batch_" + job_id.removeprefix("job-")
            r().zadd(keys().batches, {batch_id: time.time()})
            return batch_id
        batch_id = await asyncio.to_thread(make)
        return await asyncio.to_thread(known, batch_id)

    @router.get("/v1/batches", responses=errors(400, 401))
    async def list_batches(after: str | None = None,
                           limit: Annotated[int, Query(ge=1, le=100)] = 20):
        """The batches, newest first, `limit` at a time after the batch `after`."""
        def page() -> dict[str, Any]:
            ids = [m.decode() for m in r().zrevrange(keys().batches, 0, -1)]
            if after is not None:
                ids = ids[ids.index(after) + 1:] if after in ids else []
            batches = [batch_object(i) for i in ids[:limit]]
            gone = [i for i, b in zip(ids, batches) if b is None]  # expired
            if gone:
                r().zrem(keys().batches, *gone)
            found = [b for b in batches if b is not None]
            return {"object": "list", "data": found,
                    "first_id": found[0]["id"] if found else None,
                    "last_id": found[-1]["id"] if found else None, "has_more": len(ids) > limit}
        return await asyncio.to_thread(page)

    @router.get("/v1/batches/{batch_id}", responses=errors(401, 404))
    async def get_batch(batch_id: str):
        return await asyncio.to_thread(known, batch_id)

    @router.post("/v1/batches/{batch_id}/cancel", responses=errors(401, 404))
    async def cancel(batch_id: str):
        """Requests not yet started will not run; the batch is cancelled once the running
        ones end."""
        def stop() -> dict[str, Any]:
            known(batch_id)
            jobs.store.cancel("job-" + batch_id.removeprefix("batch_"))
            return known(batch_id)
        return await asyncio.to_thread(stop)

    return router
