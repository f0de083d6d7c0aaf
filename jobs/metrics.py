"""The job worker's Prometheus metrics (`shoal jobs worker --metrics-port`)."""

from prometheus_client import Counter, Gauge, Histogram

from shoal.metrics import E2E_BUCKETS

# What became of each request a job worker ran: completed, failed (rejected by the gateway, or
# the fleet unavailable past the retries), cancelled (its job was cancelled first), retried
# (the fleet unavailable now: it runs again later) or duplicate (a copy whose request had its
# result already).
JOB_REQUESTS = Counter("shoal_job_requests_total", "Requests of batch jobs run by this worker, "
                       "by outcome", ["outcome"])
JOB_REQUEST_SECONDS = Histogram("shoal_job_request_seconds",
                                "Time for one request of a batch job through the fleet",
                                buckets=E2E_BUCKETS)
# Read from Redis when scraped (every job worker reports the same fleet-wide number).
JOBS_OPEN = Gauge("shoal_jobs_open", "Batch jobs queued or running")
