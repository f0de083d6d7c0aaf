"""API keys, overload (429), body limits and requests no worker can hold, on a second gateway
process in front of the shared test fleet."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import shoal
from tests.conftest import extra_gateway

KEY = "sk-test-7f3a9c"
APP_ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def guarded(fleet):
    with extra_gateway(fleet, "--api-key", KEY, "--max-waiting", "1",
                       "--max-body-bytes", "20000", "--max-file-bytes", "60000",
                       "--allowed-origins", json.dumps([APP_ORIGIN]),
                       "--enable-request-id-headers") as url:
        yield url


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_api_keys(guarded):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(guarded + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and KEY not in r.text
    assert httpx.get(guarded + "/v1/models").status_code == 401
    assert httpx.get(guarded + "/metrics").status_code == 401
    assert httpx.get(guarded + "/healthz").status_code == 200
    assert httpx.get(guarded + "/ping").status_code == 200
    assert httpx.get(guarded + "/version").status_code == 401
    assert httpx.get(guarded + "/version", headers=AUTH).json() == {"version": shoal.__version__}
    assert httpx.get(guarded + "/readyz").status_code == 200
    for page in ("/", "/fleet"):  # the pages are public; the data they read is not
        assert httpx.get(guarded + page).status_code == 200
    assert httpx.get(guarded + "/v1/fleet").status_code == 401
    assert httpx.get(guarded + "/v1/fleet", headers=AUTH).json()["workers"][0]["worker_id"] == "w0"
    r = httpx.post(guarded + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_anthropics_clients_send_the_key_as_x_api_key(guarded):
    """The Messages API takes the key from `x-api-key` (Anthropic's clients send it so) and
    refuses a missing or wrong one with Anthropic's error body."""
    import anthropic

    ask = {"model": "SmolLM2-135M-Instruct", "max_tokens": 2,
           "messages": [{"role": "user", "content": "Hi"}]}
    for key in ("wrong", None):
        client = anthropic.Anthropic(base_url=guarded, api_key=key, max_retries=0,
                                     auth_token=None if key else "also-wrong")
        with pytest.raises(anthropic.AuthenticationError) as e:
            client.messages.create(**ask)
        assert e.value.body["error"]["type"] == "authentication_error"
        assert KEY not in str(e.value.body)
    r = anthropic.Anthropic(base_url=guarded, api_key=KEY, max_retries=0).messages.create(**ask)
    assert r.usage.output_tokens == 2
    r = httpx.post(guarded + "/v1/completions", headers={"x-api-key": KEY}, timeout=60,
                   json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200


def test_browser_apps_on_allowed_origins_may_call_the_api(guarded):
    """CORS with vLLM's --allowed-origins: a browser's preflight (which carries no API key) is
    answered for an allowed origin and refused for another; responses, a 401 among them, let
    the allowed origin's page read them."""
    preflight = {"Origin": APP_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(guarded + "/v1/chat/completions", headers=preflight, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(guarded + "/v1/chat/completions", timeout=30,
                      headers={**preflight, "Origin": "https://elsewhere.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(guarded + "/v1/chat/completions", json=body, timeout=60,
                   headers={**AUTH, "Origin": APP_ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = httpx.post(guarded + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Origin": APP_ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP_ORIGIN


def test_request_id_headers(guarded):
    """vLLM's --enable-request-id-headers: a response carries the request's X-Request-Id, or a
    new one; the reply's id is built from the client's id, the header winning over the body's
    request_id; an id too long is a 400."""
    body = {"prompt": "The sea", "max_tokens": 2, "temperature": 0}
    r = httpx.post(guarded + "/v1/completions", json=body, timeout=60,
                   headers={**AUTH, "X-Request-Id": "client-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42"
    assert r.json()["id"] == "cmpl-client-42"
    r = httpx.post(guarded + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32
    assert r.json()["id"].startswith("cmpl-") and r.headers["x-request-id"] not in r.json()["id"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "request_id": "from-body"}
    r = httpx.post(guarded + "/v1/chat/completions", json=chat, headers=AUTH, timeout=60)
    assert r.json()["id"] == "chatcmpl-from-body"
    r = httpx.post(guarded + "/v1/chat/completions", json=chat, timeout=60,
                   headers={**AUTH, "X-Request-Id": "from-header"})
    assert r.json()["id"] == "chatcmpl-from-header"
    r = httpx.post(guarded + "/v1/completions", json=body, timeout=60,
                   headers={**AUTH, "X-Request-Id": "x" * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    r = httpx.get(guarded + "/v1/models", timeout=30)  # refused (no key), still answered with one
    assert r.status_code == 401 and len(r.headers["x-request-id"]) == 32


def test_clients_may_reuse_request_ids(fleet):
    """Two requests sent at once with the same X-Request-Id both get their own tokens: the id
    names the replies, never the fleet's requests (the gateway answers without the header)."""
    prompts = ["Once upon a time", "The capital of France"]

    def body(prompt: str) -> dict:
        return {"prompt": prompt, "max_tokens": 6, "temperature": 0}

    alone = [httpx.post(fleet["url"] + "/v1/completions", json=body(p), timeout=60).json()
             for p in prompts]

    async def both() -> list[dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            rs = await asyncio.gather(*(client.post(fleet["url"] + "/v1/completions",
                                                    json=body(p),
                                                    headers={"X-Request-Id": "same"})
                                        for p in prompts))
        return [r.json() for r in rs]

    together = asyncio.run(both())
    assert [d["id"] for d in together] == ["cmpl-same", "cmpl-same"]
    assert [d["choices"][0]["text"] for d in together] == \
        [d["choices"][0]["text"] for d in alone]
    assert alone[0]["choices"][0]["text"] != alone[1]["choices"][0]["text"]


def test_the_gateway_serves_https(fleet, tmp_path):
    """--ssl-keyfile and --ssl-certfile (vLLM's): the API over TLS, verified against the
    certificate."""
    import datetime
    import ipaddress
    import ssl
    import subprocess

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from shoal.fleet import free_port, shoal_command, stop_all

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    port = free_port()
    proc = subprocess.Popen([*shoal_command(), "gateway", "--redis-url", fleet["redis"],
                             "--port", str(port), "--ssl-keyfile", str(tmp_path / "key.pem"),
                             "--ssl-certfile", str(tmp_path / "cert.pem")])
    try:
        with httpx.Client(base_url=f"https://127.0.0.1:{port}",
                          verify=ssl.create_default_context(cafile=tmp_path / "cert.pem"),
                          timeout=60) as client:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, "no HTTPS gateway"
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                                     "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"https://127.0.0.1:{port}/healthz", timeout=10)
    finally:
        stop_all([proc])


def test_websocket_checks_the_key_before_accepting(guarded):
    import websockets.sync.client as wsc
    from websockets.exceptions import InvalidStatus

    ws_url = guarded.replace("http", "ws") + "/v1/stream"
    with pytest.raises(InvalidStatus):
        wsc.connect(ws_url)
    with wsc.connect(ws_url, additional_headers=AUTH) as ws:
        ws.send(json.dumps({"prompt": "Hi", "max_tokens": 2, "temperature": 0}))
        msgs = [json.loads(ws.recv(timeout=60)) for _ in range(3)]
    assert [m["type"] for m in msgs] == ["token", "token", "done"]


def test_bad_input_is_400_never_500(guarded):
    cases = [
        (b"{not json", "application/json"),
        (json.dumps({"prompt": 5}).encode(), "application/json"),
        (json.dumps({"prompt": "x", "top_p": 1.5}).encode(), "application/json"),
        (json.dumps({"messages": [{"role": "user"}]}).encode(), "application/json"),
    ]
    for raw, ctype in cases:
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        r = httpx.post(guarded + path, content=raw,
                       headers={**AUTH, "content-type": ctype}, timeout=30)
        assert r.status_code == 400, (raw[:60], r.status_code, r.text[:200])
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_bodies_past_the_limit_get_413_with_a_length_or_without(guarded):
    """--max-body-bytes: a body whose Content-Length is past it is refused before it is read,
    a chunked one once that many bytes came; batch input files have --max-file-bytes."""
    big = json.dumps({"prompt": "x" * 30000}).encode()  # over 20,000 bytes
    headers = {**AUTH, "content-type": "application/json"}
    r = httpx.post(guarded + "/v1/completions", content=big, headers=headers, timeout=30)
    assert r.status_code == 413 and "20000 bytes" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the body comes in pieces
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]
    r = httpx.post(guarded + "/v1/completions", content=chunked(), headers=headers, timeout=30)
    assert r.status_code == 413 and "20000 bytes" in r.json()["error"]["message"]

    def batch(n: int) -> str:
        return "\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                     "url": "/v1/completions",
                                     "body": {"prompt": "x" * 100, "max_tokens": 1}})
                         for i in range(n))
    small, large = batch(200), batch(600)  # about 30 and 90 KB
    r = httpx.post(guarded + "/v1/files", files={"file": ("b.jsonl", small)},
                   data={"purpose": "batch"}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["bytes"] == len(small) > 20000
    r = httpx.post(guarded + "/v1/files", files={"file": ("b.jsonl", large)},
                   data={"purpose": "batch"}, headers=AUTH, timeout=30)
    assert r.status_code == 413 and "60000 bytes" in r.json()["error"]["message"]


def test_prompt_longer_than_the_context_window(fleet):
    r = httpx.post(fleet["url"] + "/v1/completions", timeout=30,
                   json={"prompt": [100] * 8200, "max_tokens": 4})
    err = r.json()["error"]
    assert r.status_code == 400 and "context window" in err["message"] and err["param"] == "prompt"


def test_request_larger_than_any_worker_fails_clearly(guarded):
    # 364 blocks of 16 tokens hold 5,824 tokens; ask for 7,000.
    r = httpx.post(guarded + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hello", "max_tokens": 7000, "temperature": 0})
    assert r.status_code == 400
    assert "K/V blocks" in r.json()["error"]["message"]


def test_overload_gets_429_with_retry_after(guarded, fleet):
    import redis

    r = redis.Redis.from_url(fleet["redis"])
    client = httpx.Client(timeout=120, headers=AUTH)
    # Each request reserves (5 + 4,700) / 16 = 295 of the worker's 364 blocks: one runs, the
    # next waits in the pool, and with --max-waiting 1 the third is refused.
    body = {"prompt": "Tell a very long story.", "max_tokens": 4700, "temperature": 0,
            "ignore_eos": True, "stream": True}
    streams = []
    try:
        for _ in range(2):
            cm = client.stream("POST", guarded + "/v1/completions", json=body)
            resp = cm.__enter__()
            assert resp.status_code == 200
            streams.append((cm, resp))
        deadline = time.monotonic() + 20
        while int(r.get("shoal:waiting") or 0) < 1:
            assert time.monotonic() < deadline, "the second request never waited"
            time.sleep(0.05)
        third = client.post(guarded + "/v1/completions", json={**body, "stream": False})
        assert third.status_code == 429
        assert third.headers["retry-after"] == "1"
        assert third.json()["error"]["type"] == "rate_limit_error"
    finally:
        for cm, _ in streams:
            cm.__exit__(None, None, None)
        client.close()
    deadline = time.monotonic() + 30
    while int(r.get("shoal:waiting") or 0) != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_per_key_request_and_token_limits(fleet):
    with extra_gateway(fleet, "--api-key", "key-a", "--api-key", "key-b",
                       "--requests-per-minute", "2", "--tokens-per-minute", "60") as url:
        if time.time() % 60 > 45:  # keep the test inside one fixed one-minute window
            time.sleep(61 - time.time() % 60)

        def post(key, max_tokens=3):
            return httpx.post(url + "/v1/completions", timeout=60,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"prompt": "Hi there", "max_tokens": max_tokens, "temperature": 0})

        too_many_tokens = post("key-a", max_tokens=100)  # 2 + 100 tokens > 60: refused, not counted
        assert too_many_tokens.status_code == 429 and "tokens" in too_many_tokens.json()["error"]["message"]
        assert [post("key-a").status_code for _ in range(3)] == [200, 200, 429]
        third = post("key-a")
        assert third.status_code == 429 and third.headers["retry-after"] == "1"
        assert third.json()["error"]["type"] == "rate_limit_error"
        assert post("key-b").status_code == 200  # budgets are per key
