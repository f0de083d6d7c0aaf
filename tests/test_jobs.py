"""Batch jobs end to end: a real fleet (Redis, scheduler, worker, gateway), a real Celery worker
process started by a fixture, the real model (docs/jobs.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from shoal.fleet import free_port, shoal_command, stop_all
from tests.conftest import finished_requests, running_fleet

VISIBILITY_TIMEOUT_S = 4  # a dead Celery worker's tasks come back this soon (production: 300)


@pytest.fixture(scope="module")
def jobs_fleet(tmp_path_factory):
    """A fleet whose worker runs at most 2 requests at once, so job requests queue in the
    scheduler and priorities matter."""
    log = tmp_path_factory.mktemp("jobs") / "scheduler.log"
    with running_fleet(("--max-num-seqs", "2"), scheduler_log=log) as fleet:
        fleet["scheduler_log"] = log
        yield fleet


class CeleryWorker:
    """`shoal jobs worker` as a process we can kill and start again."""

    def __init__(self, fleet: dict, concurrency: int = 4) -> None:
        self.fleet, self.concurrency, self.proc = fleet, concurrency, None
        self.metrics_port = free_port()

    def start(self) -> None:
        env = {**os.environ, "SHOAL_JOBS_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT_S)}
        self.proc = subprocess.Popen(
            shoal_command("jobs", "worker", "--redis-url", self.fleet["redis"], "--gateway-url",
                          self.fleet["url"], "--concurrency", str(self.concurrency),
                          "--metrics-port", str(self.metrics_port)),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def metrics(self) -> dict[str, float]:
        """The worker's metric samples, by name and labels (`name{label=value}`)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        stop_all([self.proc])


@pytest.fixture()
def celery_worker(jobs_fleet, request):
    """A Celery worker for one test; `indirect` parametrization sets its concurrency."""
    w = CeleryWorker(jobs_fleet, getattr(request, "param", 4))
    w.start()
    yield w
    w.stop()


def _prompts(n: int) -> list[str]:
    subjects = ["the sea", "a lighthouse", "ships", "the tide", "a storm", "fish", "sailors"]
    return [f"Write one sentence about {subjects[i % len(subjects)]} number {i}:" for i in range(n)]


def _submit(fleet, lines: list[dict]) -> str:
    body = "\n".join(json.dumps(line) for line in lines)
    r = httpx.post(f"{fleet['url']}/v1/jobs", content=body, timeout=30)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and job["request_counts"]["total"] == len(lines)
    return job["id"]


def _status(fleet, job_id: str) -> dict:
    r = httpx.get(f"{fleet['url']}/v1/jobs/{job_id}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(fleet, job_id: str, until, timeout_s: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = _status(fleet, job_id)
        if until(job):
            return job
        assert time.monotonic() < deadline, f"job stuck: {job}"
        time.sleep(0.2)


def _terminal(job: dict) -> bool:
    c = job["request_counts"]
    return job["status"] in ("completed", "failed", "cancelled") and \
        c["completed"] + c["failed"] + c["cancelled"] == c["total"]


def _results(fleet, job_id: str) -> list[dict]:
    r = httpx.get(f"{fleet['url']}/v1/jobs/{job_id}/results", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/jsonl")
    return [json.loads(line) for line in r.text.splitlines()]


def test_job_results_equal_the_fleets_greedy_outputs_in_input_order(jobs_fleet, celery_worker):
    prompts = _prompts(20)
    lines = [{"custom_id": f"req-{i:02d}", "prompt": p, "max_tokens": 6, "temperature": 0}
             for i, p in enumerate(prompts)]
    lines[7] = {"custom_id": "chat-07", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": prompts[7]}], "max_tokens": 6,
                         "temperature": 0}}
    lines[11] = {"custom_id": "resp-11", "method": "POST", "url": "/v1/responses",
                 "body": {"input": prompts[11], "max_output_tokens": 6, "temperature": 0}}
    lines[12] = {"custom_id": "resp-12", "input": prompts[12], "max_output_tokens": 6,
                 "temperature": 0}  # the flat form: a response request by its `input`
    job_id = _submit(jobs_fleet, lines)
    job = _wait(jobs_fleet, job_id, _terminal)
    assert job["status"] == "completed" and job["request_counts"]["completed"] == 20
    assert job["created_at"] <= job["started_at"] <= job["finished_at"]
    results = _results(jobs_fleet, job_id)
    assert [r["custom_id"] for r in results] == [line["custom_id"] for line in lines]
    for line, result in zip(lines, results):
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = line.get("body") or {k: v for k, v in line.items() if k != "custom_id"}
        if "input" in body:  # the same request straight to the fleet, greedy
            direct = httpx.post(f"{jobs_fleet['url']}/v1/responses", json=body, timeout=60).json()
            ours = result["response"]["body"]
            assert ours["object"] == "response" and ours["output"] == [
                {**direct["output"][0], "id": ours["output"][0]["id"]}]
        elif "body" in line:
            direct = httpx.post(f"{jobs_fleet['url']}/v1/chat/completions", json=line["body"],
                                timeout=60).json()
            ours = result["response"]["body"]["choices"][0]["message"]["content"]
            assert ours == direct["choices"][0]["message"]["content"]
        else:
            direct = httpx.post(f"{jobs_fleet['url']}/v1/completions", json=body, timeout=60).json()
            assert result["response"]["body"]["choices"][0]["text"] == direct["choices"][0]["text"]
            assert result["response"]["body"]["usage"]["completion_tokens"] == 6
    seen = celery_worker.metrics()  # the job worker's own metrics
    assert seen["shoal_job_requests_total{outcome=completed}"] == 20
    # Copies the starting worker queued again (`requeue_unfinished`) may have run beside their
    # originals: timed, but recorded once.
    assert seen["shoal_job_request_seconds_count"] >= 20 and seen["shoal_jobs_open"] == 0


def test_openais_batch_api_runs_a_file_of_requests_as_a_job(jobs_fleet, celery_worker,
                                                            tmp_path):
    """OpenAI's client, unchanged: a JSONL file uploaded, a batch made of it and run by the
    Celery worker, its output file holding each request's greedy reply in input order and its
    error file the request the fleet refused; the input file deleted, the batch stays."""
    import openai

    client = openai.OpenAI(base_url=jobs_fleet["url"] + "/v1", api_key="none")
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": p}], "max_tokens": 6,
                       "temperature": 0}} for i, p in enumerate(_prompts(4))]
    lines.insert(2, {**lines[0], "custom_id": "unknown-model",
                     "body": {**lines[0]["body"], "model": "no-such-model"}})
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == path.stat().st_size
    assert client.files.content(uploaded.id).content == path.read_bytes()
    assert uploaded.id in [f.id for f in client.files.list().data]

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "test"})
    assert batch.status == "in_progress" and batch.request_counts.total == 5
    assert batch.metadata == {"run": "test"} and batch.input_file_id == uploaded.id
    deadline = time.monotonic() + 240
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    assert batch.completed_at >= batch.created_at
    assert client.batches.list().data[0].id == batch.id

    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == ["b0", "b1", "b2", "b3"]
    for o in output:
        direct = httpx.post(f"{jobs_fleet['url']}/v1/chat/completions", timeout=60,
                            json=next(x["body"] for x in lines if x["custom_id"] == o["custom_id"]))
        assert o["response"]["body"]["choices"][0]["message"]["content"] == \
            direct.json()["choices"][0]["message"]["content"]
    (refused,) = [json.loads(x) for x in
                  client.files.content(batch.error_file_id).text.splitlines()]
    assert refused["custom_id"] == "unknown-model" and refused["error"]["code"] == "rejected"
    assert refused["response"]["status_code"] == 404
    made = client.files.retrieve(batch.output_file_id)
    assert made.purpose == "batch_output" and made.created_at == int(batch.completed_at)
    assert made.expires_at == made.created_at + 30 * 86400  # kept as its job is
    import redis as redis_lib

    r = redis_lib.Redis.from_url(jobs_fleet["redis"])
    job = "job-" + batch.id.removeprefix("batch_")
    for key in (f"shoal:job:{job}", f"shoal:job:{job}:requests", f"shoal:job:{job}:results"):
        assert 30 * 86400 - 100 < r.ttl(key) <= 30 * 86400, key

    client.files.delete(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    assert client.batches.retrieve(batch.id).status == "completed"
    assert client.batches.cancel(batch.id).status == "completed"  # a finished batch stays so
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    other = client.files.create(file=path.open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=other.id, endpoint="/v1/completions",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=path.open("rb"), purpose="fine-tune")
    # expires_after: kept an hour instead of 30 days (the key's TTL), within OpenAI's bounds.
    hour = client.files.create(file=path.open("rb"), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert hour.expires_at == hour.created_at + 3600 == client.files.retrieve(hour.id).expires_at
    assert 3500 < r.ttl(f"shoal:file:{hour.id}") <= 3600
    assert other.expires_at == other.created_at + 30 * 86400
    with pytest.raises(openai.BadRequestError, match="expires_after"):
        client.files.create(file=path.open("rb"), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 60})
    with pytest.raises(openai.BadRequestError, match="output_expires_after.seconds"):
        client.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions",
                              completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 60})

    # Cancelled: cancelling while its running requests end, then cancelled, the requests that
    # never ran in the error file.
    path.write_text("".join(json.dumps({**lines[0], "custom_id": f"c{i}", "body": {
        **lines[0]["body"], "max_tokens": 32, "ignore_eos": True}}) + "\n" for i in range(12)))
    batch = client.batches.create(input_file_id=client.files.create(
        file=path.open("rb"), purpose="batch").id, endpoint="/v1/chat/completions",
        completion_window="24h", output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status != "cancelled":
        assert batch.status == "cancelling" and time.monotonic() < deadline, batch
        time.sleep(0.2)
    cancelled = [json.loads(x)["error"]["code"] for x in
                 client.files.content(batch.error_file_id).text.splitlines()]
    assert cancelled and set(cancelled) == {"cancelled"}
    assert batch.request_counts.completed + len(cancelled) == 12
    errors = client.files.retrieve(batch.error_file_id)  # kept its output_expires_after
    assert errors.expires_at == errors.created_at + 7200
    assert 7100 < r.ttl("shoal:job:job-" + batch.id.removeprefix("batch_")) <= 7200


def test_bad_jobs_are_refused_with_a_clear_error(jobs_fleet):
    url = f"{jobs_fleet['url']}/v1/jobs"
    for body, needle in [("not json", "neither"),
                         ('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "a", "prompt": "y"}',
                          "repeated"),
                         ('[{"prompt": "x"}]', "custom_id"),
                         ('[{"custom_id": "a", "prompt": "x", "max_tokens": -1}]', "max_tokens"),
                         ('[{"custom_id": "a", "input": "x", "background": true}]',
                          "background")]:
        r = httpx.post(url, content=body, timeout=30)
        assert r.status_code == 400, body
        assert needle in r.json()["error"]["message"]
    assert httpx.get(f"{url}/job-nope", timeout=30).status_code == 404
    assert httpx.post(f"{url}/job-nope/cancel", timeout=30).status_code == 404


def test_cancel_stops_requests_not_yet_started(jobs_fleet, celery_worker):
    lines = [{"custom_id": f"c{i}", "prompt": p, "max_tokens": 24, "temperature": 0,
              "ignore_eos": True} for i, p in enumerate(_prompts(30))]
    job_id = _submit(jobs_fleet, lines)
    _wait(jobs_fleet, job_id, lambda j: j["request_counts"]["completed"] >= 2)
    r = httpx.post(f"{jobs_fleet['url']}/v1/jobs/{job_id}/cancel", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    job = _wait(jobs_fleet, job_id, _terminal)
    c = job["request_counts"]
    assert job["status"] == "cancelled" and job["cancelled_at"] is not None
    assert c["completed"] >= 2 and c["cancelled"] >= 10 and c["failed"] == 0
    assert c["completed"] + c["cancelled"] == 30
    results = _results(jobs_fleet, job_id)
    assert len(results) == 30
    done = [r for r in results if r["response"]]
    cancelled = [r for r in results if r["error"] and r["error"]["code"] == "cancelled"]
    assert len(done) == c["completed"] and len(cancelled) == c["cancelled"]


def test_job_survives_a_killed_celery_worker_without_duplicates(jobs_fleet):
    worker = CeleryWorker(jobs_fleet)
    worker.start()
    lines = [{"custom_id": f"k{i}", "prompt": p, "max_tokens": 12, "temperature": 0,
              "ignore_eos": True} for i, p in enumerate(_prompts(20))]
    try:
        job_id = _submit(jobs_fleet, lines)
        _wait(jobs_fleet, job_id, lambda j: j["request_counts"]["completed"] >= 3)
        worker.kill()  # mid-job: some requests in flight, most still queued
        killed_at = _status(jobs_fleet, job_id)["request_counts"]["completed"]
        assert killed_at < 20
        time.sleep(1.0)
        worker.start()
        job = _wait(jobs_fleet, job_id, _terminal)
    finally:
        worker.stop()
    assert job["status"] == "completed" and job["request_counts"]["completed"] == 20
    results = _results(jobs_fleet, job_id)
    ids = [r["custom_id"] for r in results]
    assert ids == [line["custom_id"] for line in lines]  # each custom_id exactly once, in order
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 12 for r in results)


def test_a_starting_worker_runs_the_requests_whose_tasks_were_lost(jobs_fleet):
    """A task a killed worker took along (kombu pops a message before it records it as
    unacknowledged) is run by the next worker that starts: it queues again every request of a
    queued or running job without a result. Here the broker's queue is emptied while no
    Celery worker runs, losing the tasks of a running job and the whole of a queued one."""
    import redis as redis_lib

    r = redis_lib.Redis.from_url(jobs_fleet["redis"])
    broker = [b"shoal:celery:celery", b"shoal:celery:unacked", b"shoal:celery:unacked_index"]
    running = [{"custom_id": f"l{i}", "prompt": p, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True} for i, p in enumerate(_prompts(12))]
    worker = CeleryWorker(jobs_fleet)
    worker.start()
    try:
        first = _submit(jobs_fleet, running)
        _wait(jobs_fleet, first, lambda j: j["request_counts"]["completed"] >= 2)
    finally:
        worker.stop()  # a warm shutdown: what it had reserved goes back to the queue
    queued = _submit(jobs_fleet, running[:3])  # no worker: its run_job task waits
    assert r.exists(broker[0]) and r.delete(*broker)  # every queued task lost
    assert _status(jobs_fleet, first)["request_counts"]["completed"] < 12
    assert _status(jobs_fleet, queued)["status"] == "queued"
    worker.start()
    try:
        for job_id, lines in ((first, running), (queued, running[:3])):
            job = _wait(jobs_fleet, job_id, _terminal, timeout_s=120)
            assert job["status"] == "completed"
            assert job["request_counts"]["completed"] == len(lines)
            assert [x["custom_id"] for x in _results(jobs_fleet, job_id)] == \
                [line["custom_id"] for line in lines]
    finally:
        worker.stop()


def test_unfinished_reads_only_open_jobs_and_their_missing_requests(jobs_fleet):
    """`JobStore.unfinished` (what a starting Celery worker queues again) names the queued and
    running jobs only, each with the indexes of its requests that have no result; a job leaves
    the open set when it finishes or is cancelled."""
    import redis as redis_lib

    from shoal.jobs import JOBS_TTL_S, JobStore

    store = JobStore(redis_lib.Redis.from_url(jobs_fleet["redis"]), prefix="unfinished-test")
    items = [{"custom_id": f"c{i}", "endpoint": "completions", "body": {"prompt": "x"}}
             for i in range(4)]
    running, finished, cancelled, queued = (store.create(items) for _ in range(4))
    store.start(running)
    store.record(running, "c2", {"custom_id": "c2"}, "completed")
    for item in items:
        store.record(finished, item["custom_id"], {"custom_id": item["custom_id"]}, "completed")
    store.record(cancelled, "c0", {"custom_id": "c0"}, "completed")
    assert store.cancel(cancelled) == "cancelled"
    assert store.status(finished)["status"] == "completed"
    assert store.unfinished() == {running: [0, 1, 3], queued: [0, 1, 2, 3]}
    assert {m.decode() for m in store.r.smembers(store.keys.jobs_open)} == {running, queued}
    # A finished job's keys expire after its ttl_s (30 days by default); open ones do not.
    for job in (running, cancelled, queued):
        assert store.r.ttl(store.keys.job(job)) == -1
    for key in (store.keys.job(finished), store.keys.job_requests(finished),
                store.keys.job_results(finished)):
        assert JOBS_TTL_S - 100 < store.r.ttl(key) <= JOBS_TTL_S
    status = store.status(finished)
    assert status["expires_at"] == status["finished_at"] + JOBS_TTL_S
    brief = store.create(items[:1], ttl_s=1)
    store.record(brief, "c0", {"custom_id": "c0"}, "completed")
    deadline = time.monotonic() + 10
    while store.r.exists(store.keys.job(brief), store.keys.job_requests(brief),
                         store.keys.job_results(brief)):
        assert time.monotonic() < deadline, "a finished job's keys did not expire"
        time.sleep(0.1)
    assert store.status(brief) is None


@pytest.mark.parametrize("celery_worker", [8], indirect=True)
def test_interactive_requests_go_before_queued_job_requests(jobs_fleet, celery_worker):
    lines = [{"custom_id": f"p{i}", "prompt": p, "max_tokens": 10 + (7 * i) % 17,
              "temperature": 0, "ignore_eos": True} for i, p in enumerate(_prompts(16))]
    job_id = _submit(jobs_fleet, lines)
    # The worker runs 2 requests and the Celery worker keeps 8 in the fleet: 6 wait. With only
    # 2 waiting, two job requests ending together on a fast host emptied the queue for the
    # moment Celery took to send the next ones, and the interactive request met none.
    _wait(jobs_fleet, job_id, lambda j: j["request_counts"]["completed"] >= 2)
    r = httpx.post(f"{jobs_fleet['url']}/v1/completions",
                   json={"prompt": "Hello there,", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    interactive = r.json()["id"]
    _wait(jobs_fleet, job_id, _terminal)
    time.sleep(0.5)  # the scheduler's last log lines
    log = finished_requests(jobs_fleet["scheduler_log"])
    me = log[interactive]
    assert me["priority"] == 0
    admitted = me["arrival_time"] + me["queue_time_s"]
    first_token = me["arrival_time"] + me["ttft_s"]
    queued = [e for e in log.values() if e["priority"] == 1
              and e["arrival_time"] < me["arrival_time"] < e["arrival_time"] + e["queue_time_s"]]
    assert queued, "no job request was waiting when the interactive one arrived"
    # Every job request waiting at its arrival was admitted after it, or with it in one plan:
    # the log rounds arrival and queue times to 0.1 ms each, so one plan's admissions read back
    # up to 0.2 ms apart (a run saw a job request 0.1 ms "before" the interactive one).
    for e in queued:
        assert e["arrival_time"] + e["queue_time_s"] >= admitted - 2e-4
    print(f"interactive admitted {admitted - me['arrival_time']:.3f} s after arrival, first token "
          f"{first_token - me['arrival_time']:.3f} s; {len(queued)} job requests were waiting")


def test_cli_submits_waits_and_writes_results(jobs_fleet, celery_worker, tmp_path):
    jobfile, out = tmp_path / "job.jsonl", tmp_path / "results.jsonl"
    jobfile.write_text("\n".join(json.dumps({"custom_id": f"cli{i}", "prompt": p, "max_tokens": 4,
                                             "temperature": 0})
                                 for i, p in enumerate(_prompts(5))))
    url = jobs_fleet["url"]
    run = subprocess.run(shoal_command("jobs", "submit", str(jobfile), "--wait", "--url", url,
                                       "--output", str(out)),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    job_id = run.stdout.split()[0]
    assert "completed (completed 5, failed 0, cancelled 0 of 5)" in run.stderr
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == \
        [f"cli{i}" for i in range(5)]
    status = subprocess.run(shoal_command("jobs", "status", job_id, "--url", url),
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and json.loads(status.stdout)["status"] == "completed"
    missing = subprocess.run(shoal_command("jobs", "submit", str(tmp_path / "nope.jsonl"),
                                           "--url", url), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    assert "Traceback" not in missing.stderr
