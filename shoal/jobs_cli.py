"""`shoal jobs ...`: submit batch jobs to a gateway and follow them; run the Celery worker.

    shoal jobs submit FILE.jsonl [--wait]     POST /v1/jobs, then a progress bar until it ends
    shoal jobs status ID                      GET /v1/jobs/ID
    shoal jobs results ID [--output F]        GET /v1/jobs/ID/results (JSONL)
    shoal jobs cancel ID                      POST /v1/jobs/ID/cancel
    shoal jobs worker --redis-url URL         a Celery worker running jobs through a gateway
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from shoal.jobs import TERMINAL


class JobsCLIError(Exception):
    """A one-line error for the user (the CLI prints it and exits non-zero)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    j = sub.add_parser("jobs", help="batch jobs: submit, follow, cancel; run the Celery worker")
    jsub = j.add_subparsers(dest="jobs_command", required=True)

    def client(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
        p.add_argument("--api-key", default=os.environ.get("SHOAL_API_KEY"),
                       help="API key (default $SHOAL_API_KEY)")
        return p

    s = client(jsub.add_parser("submit", help="submit a JSONL (or JSON list) file of requests"))
    s.add_argument("file", help="one request per line, each with a custom_id")
    s.add_argument("--wait", action="store_true", help="follow the job to its end")
    s.add_argument("--output", default=None, help="with --wait: write the results here")
    client(jsub.add_parser("status", help="a job's status and counts")).add_argument("id")
    r = client(jsub.add_parser("results", help="a job's results as JSONL, in input order"))
    r.add_argument("id")
    r.add_argument("--output", default=None, help="file to write (default: stdout)")
    client(jsub.add_parser("cancel", help="cancel a job's requests not yet started")).add_argument("id")
    w = jsub.add_parser("worker", help="a Celery worker that runs jobs through a gateway")
    w.add_argument("--redis-url", required=True, help="the fleet's Redis (broker, results, jobs)")
    w.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    w.add_argument("--prefix", default="shoal", help="Redis key prefix")
    w.add_argument("--concurrency", type=int, default=8,
                   help="requests a worker sends to the fleet at once (bounds a job's share)")
    w.add_argument("--api-key", default=os.environ.get("SHOAL_API_KEY"))
    w.add_argument("--metrics-port", type=int, default=0,
                   help="serve /metrics here (0 = off): requests run by outcome, their time "
                        "through the fleet, jobs open")


def run(args: argparse.Namespace) -> int:
    """Run `shoal jobs ...`. Raises JobsCLIError for errors the user can fix."""
    if args.jobs_command == "worker":
        return _worker(args)
    import httpx

    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/")
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=60) as http:
            if args.jobs_command == "submit":
                return _submit(http, args)
            if args.jobs_command == "status":
                print(json.dumps(_ok(http.get(f"/v1/jobs/{args.id}")).json(), indent=2))
                return 0
            if args.jobs_command == "cancel":
                print(json.dumps(_ok(http.post(f"/v1/jobs/{args.id}/cancel")).json(), indent=2))
                return 0
            return _results(http, args.id, args.output)
    except httpx.HTTPError as e:
        raise JobsCLIError(f"cannot reach the gateway at {base}: {e}") from e


def _ok(r):
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise JobsCLIError(f"gateway answered {r.status_code}: {message}")
    return r


def _submit(http, args: argparse.Namespace) -> int:
    try:
        body = Path(args.file).read_text(encoding="utf-8")
    except OSError as e:
        raise JobsCLIError(f"cannot read {args.file}: {e}") from e
    job = _ok(http.post("/v1/jobs", content=body.encode(),
                        headers={"content-type": "application/jsonl"})).json()
    print(job["id"], flush=True)
    if not args.wait:
        return 0
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = job["request_counts"]["total"]
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=False) as progress:
        bar = progress.add_task(job["status"], total=total)
        while job["status"] not in TERMINAL:
            time.sleep(0.5)
            job = _ok(http.get(f"/v1/jobs/{job['id']}")).json()
            c = job["request_counts"]
            progress.update(bar, completed=c["completed"] + c["failed"] + c["cancelled"],
                            description=job["status"])
    c = job["request_counts"]
    print(f"{job['id']}: {job['status']} (completed {c['completed']}, failed {c['failed']}, "
          f"cancelled {c['cancelled']} of {c['total']})", file=sys.stderr)
    if args.output:
        _results(http, job["id"], args.output)
    return 0 if job["status"] == "completed" else 1


def _results(http, job_id: str, output: str | None) -> int:
    text = _ok(http.get(f"/v1/jobs/{job_id}/results")).text
    if output:
        Path(output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _worker(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise JobsCLIError("--concurrency must be at least 1")
    os.environ["SHOAL_REDIS_URL"] = args.redis_url
    os.environ["SHOAL_PREFIX"] = args.prefix
    os.environ["SHOAL_GATEWAY_URL"] = args.gateway_url
    if args.api_key:
        os.environ["SHOAL_API_KEY"] = args.api_key
    from jobs.tasks import app, serve_metrics  # reads the environment above

    serve_metrics(args.metrics_port)
    app.worker_main(["worker", "--pool", "threads", "--concurrency", str(args.concurrency),
                     "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                     "--hostname", f"shoal-jobs-{os.getpid()}@%h"])
    return 0
