"""Prometheus metrics of a real fleet, the dashboard's expressions, and a real Prometheus server."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "shoal-overview.json"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page as {(name, sorted labels): value}."""
    text = httpx.get(url, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape_all(fleet) -> dict[str, dict]:
    return {part: scrape(url) for part, url in fleet["metrics"].items()}


def dashboard_exprs() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] for t in p["targets"]]


def test_counters_and_histograms_move_by_the_right_amounts(fleet, tokenizer):
    before = scrape_all(fleet)
    prompts = ["One fish", "Two fish, red fish", "Blue fish swim in the deep sea"]
    streamed = 0
    for p in prompts:
        r = httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                       json={"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        streamed += r.json()["usage"]["completion_tokens"]
    assert httpx.post(fleet["url"] + "/v1/completions", json={"prompt": ""}, timeout=30).status_code == 400
    time.sleep(1.5)  # the scheduler's gauges and the workers' heartbeats settle
    after = scrape_all(fleet)

    def delta(part, name, **labels):
        return value(after[part], name, **labels) - value(before[part], name, **labels)

    g = "gateway"
    assert delta(g, "shoal_requests_total", endpoint="/v1/completions", status="200") == 3
    assert delta(g, "shoal_requests_total", endpoint="/v1/completions", status="400") == 1
    m = {"model_name": "SmolLM2-135M-Instruct"}
    assert delta(g, "shoal_generation_tokens_total", **m) == streamed == 15
    prompt_tokens = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    assert delta(g, "shoal_prompt_tokens_total", **m) == prompt_tokens
    assert delta(g, "shoal_time_to_first_token_seconds_count", **m) == 3
    assert delta(g, "shoal_e2e_request_latency_seconds_count", **m) == 3
    assert delta(g, "shoal_inter_token_latency_seconds_count", **m) == 12
    assert value(after[g], "shoal_active_streams") == 0

    s = "scheduler"
    assert delta(s, "shoal_requests_finished_total", finish_reason="length") == 3
    assert delta(s, "shoal_request_queue_time_seconds_count") == 3
    assert delta(s, "shoal_iteration_batch_size_count") >= 5  # one prefill + 4 decodes each
    assert delta(s, "shoal_scheduling_seconds_count") >= 5
    assert value(after[s], "shoal_workers_alive") == 1
    assert value(after[s], "shoal_kv_blocks_total", worker="w0") == 364
    assert value(after[s], "shoal_kv_blocks_free", worker="w0") == 364
    assert value(after[s], "shoal_requests_running") == 0

    w = "worker"
    assert delta(w, "shoal_engine_tokens_total", phase="prefill") == prompt_tokens
    assert delta(w, "shoal_engine_tokens_total", phase="decode") == 12
    assert delta(w, "shoal_engine_step_seconds_count", phase="decode") >= 4
    assert value(after[w], "shoal_kv_cache_usage_ratio") == 0.0
    assert value(after[w], "shoal_model_load_seconds") > 0


def test_structured_outputs_count_their_masked_rows_and_mask_time(fleet):
    before = scrape_all(fleet)
    r = httpx.post(fleet["url"] + "/v1/completions", timeout=60, json={
        "prompt": "My phone number is", "max_tokens": 20, "temperature": 0,
        "structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert r.status_code == 200, r.text
    after = scrape_all(fleet)
    rows = (value(after["worker"], "shoal_structured_output_rows_total")
            - value(before["worker"], "shoal_structured_output_rows_total"))
    assert rows == r.json()["usage"]["completion_tokens"] > 0  # every token from a masked row
    assert (value(after["worker"], "shoal_structured_output_mask_seconds_total")
            > value(before["worker"], "shoal_structured_output_mask_seconds_total"))


def test_no_request_id_in_any_label(fleet):
    for part, samples in scrape_all(fleet).items():
        for (_name, labels) in samples:
            for k, v in labels:
                assert not re.match(r"(cmpl|chatcmpl)-", str(v)), (part, k, v)


def test_dashboard_expressions_use_exported_metrics_and_parse(fleet, tmp_path):
    exported = {name for samples in scrape_all(fleet).values() for (name, _) in samples}
    exprs = dashboard_exprs()
    assert len(exprs) >= 12
    for e in exprs:
        names = re.findall(r"\bshoal_[a-z0-9_]+", e)
        assert names, e
        for n in names:
            assert n in exported, f"{n} (in {e!r}) is exported by no part"
    promtool = shutil.which("promtool")
    if promtool is None:
        assert not os.environ.get("CI"), "CI installs Debian's prometheus package (promtool)"
        pytest.skip("promtool is not installed")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"shoal:dashboard:{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_prometheus_evaluates_every_dashboard_expression(fleet):
    binary = shutil.which("prometheus")
    if binary is None:
        assert not os.environ.get("CI"), "CI installs Debian's prometheus package"
        pytest.skip("the prometheus binary is not installed (apt-get install prometheus)")
    targets = [u.removeprefix("http://").removesuffix("/metrics") for u in fleet["metrics"].values()]
    workdir = Path(tempfile.mkdtemp(prefix="shoal-prom-"))
    (workdir / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "shoal", "static_configs": [{"targets": targets}]}]}))
    port = _free_port()
    prom = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{api}/targets", timeout=2)
                # While its storage opens Prometheus answers 503 with a plain-text body.
                if r.status_code == 200:
                    t = r.json()["data"]["activeTargets"]
                    if len(t) == 3 and all(x["health"] == "up" for x in t):
                        break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Prometheus never scraped the fleet"
            time.sleep(0.5)
        # Traffic while Prometheus watches, so rates and quantiles have data.
        for i in range(4):
            httpx.post(fleet["url"] + "/v1/completions", timeout=60,
                       json={"prompt": f"Fish number {i}", "max_tokens": 4, "temperature": 0})
            time.sleep(1)
        httpx.post(fleet["url"] + "/v1/completions", json={"prompt": "x", "n": 3}, timeout=30)
        time.sleep(3)
        empty = []
        for e in dashboard_exprs():
            r = httpx.get(f"{api}/query", params={"query": e}, timeout=10).json()
            assert r["status"] == "success", (e, r)
            if not r["data"]["result"]:
                empty.append(e)
        assert not empty, f"expressions with no result: {empty}"
    finally:
        prom.terminate()
        prom.wait(20)
        shutil.rmtree(workdir, ignore_errors=True)


def test_one_json_log_line_per_finished_request(caplog):
    """The scheduler's per-request log: the fields operators need, never the prompt or output."""
    import logging

    from scheduler.core import RequestState
    from scheduler.server import SchedulerServer
    from shoal.messages import RequestSubmission
    from shoal.sampling_params import SamplingParams

    sub = RequestSubmission("cmpl-x", "m", [901, 902, 903], SamplingParams(max_tokens=4), 100.0, "chan")
    state = RequestState(sub, output_token_ids=[7, 8], admitted_at=100.5, first_token_at=100.75)
    with caplog.at_level(logging.INFO, logger="shoal.scheduler"):
        SchedulerServer._log_finished(state, "length", "w0", 101.0)
    line = json.loads(caplog.records[-1].getMessage())
    assert line == {"event": "request_finished", "request_id": "cmpl-x", "model": "m", "worker": "w0",
                    "priority": 0, "arrival_time": 100.0,
                    "prompt_tokens": 3, "generated_tokens": 2, "queue_time_s": 0.5, "ttft_s": 0.75,
                    "e2e_s": 1.0, "finish_reason": "length"}
    assert "901" not in caplog.text
