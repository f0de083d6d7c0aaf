"""Redis key names, built in one place, all under one configurable prefix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key names of one fleet. Two fleets share a Redis server by using different prefixes.

    Structures (see docs/protocol.md for writers and readers):
        requests: stream of `RequestSubmission`, read by the scheduler's consumer group.
        workers: set of registered worker ids.
        worker(id): hash, the worker's latest `WorkerInfo` under field "info".
        alive(id): string with a TTL, the worker's heartbeat.
        plans(id): list of `IterationPlan` for one worker (scheduler RPUSH, worker BLPOP).
        results: list of `IterationResult` from every worker (worker RPUSH, scheduler BLPOP).
        tokens(gateway): pub/sub channel of `TokenEvents` (one message per iteration) for one
            gateway instance.
        cancels: list of `Cancel` (gateway RPUSH, scheduler drains).
        wakeups: list that rings the scheduler (gateway RPUSH after each request and cancel,
            trimmed to one entry; scheduler BLPOPs it beside `results`, deletes it when it reads).
        waiting: integer, requests waiting in the scheduler's pool (scheduler SET, gateways read
            it at start-up and after a Redis outage to refuse work beyond their bound with 429).
        waiting_updates: pub/sub channel of the same integer, published with each change: the
            gateways keep it in memory rather than read it per request.
        lease: the active scheduler's id, with a TTL (SET NX PX, renewed by its holder).
        progress(id): list of a request's generated token ids, for a scheduler taking over.
        jobs_open, job(id), job_requests(id), job_results(id): batch jobs (shoal/jobs.py).
        files, file(id), batches: OpenAI's Files and Batch APIs over batch jobs
            (gateway/batches.py).
        response(id): string with a TTL, a stored Responses API response and the input items
            it answered (JSON; gateway/responses.py `ResponseStore`).
        loras(model): hash, the LoRA adapters loaded into a model's fleet at run time (adapter
            name -> PEFT directory on the workers): gateways write it (`/v1/load_lora_adapter`,
            `/v1/unload_lora_adapter`) and read it to name the adapters they serve; workers
            read it with each heartbeat and load or drop adapters to match.
        response_events(id): stream with a TTL, a streamed background response's events, entry
            id `0-(sequence_number + 1)`, field "event" (JSON), for clients that (re)connect.
    """

    prefix: str = "shoal"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    scheduler_group: str = "schedulers"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def alive(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}:alive"

    def plans(self, worker_id: str) -> str:
        return f"{self.prefix}:plans:{worker_id}"

    @property
    def results(self) -> str:
        return f"{self.prefix}:results"

    def tokens(self, gateway_id: str) -> str:
        return f"{self.prefix}:tokens:{gateway_id}"

    @property
    def cancels(self) -> str:
        return f"{self.prefix}:cancels"

    @property
    def wakeups(self) -> str:
        return f"{self.prefix}:scheduler:wakeups"

    @property
    def waiting(self) -> str:
        return f"{self.prefix}:waiting"

    @property
    def waiting_updates(self) -> str:
        return f"{self.prefix}:waiting:updates"

    @property
    def lease(self) -> str:
        return f"{self.prefix}:scheduler:lease"

    def progress(self, request_id: str) -> str:
        return f"{self.prefix}:progress:{request_id}"

    @property
    def files(self) -> str:
        return f"{self.prefix}:files"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    def response(self, response_id: str) -> str:
        return f"{self.prefix}:response:{response_id}"

    def response_events(self, response_id: str) -> str:
        """A streamed background response's events (a Redis stream, one entry per event)."""
        return f"{self.prefix}:response-events:{response_id}"

    def rate(self, who: str, what: str, minute: int) -> str:
        """Counter of `what` ("requests" or "tokens") used by `who` (a key hash) in `minute`."""
        return f"{self.prefix}:rate:{who}:{what}:{minute}"

    @property
    def jobs_open(self) -> str:
        return f"{self.prefix}:jobs:open"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def job_requests(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:requests"

    def job_results(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}:results"

    def loras(self, model: str) -> str:
        return f"{self.prefix}:loras:{model}"
