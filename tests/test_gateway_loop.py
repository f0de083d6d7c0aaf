"""The gateway's event loop serves every stream, so what takes it milliseconds per request runs
elsewhere: chat templates and tokenization on its preparing thread (`Gateway.prepare`). The app
in-process against a real redis-server; no worker is needed to tokenize."""

from __future__ import annotations

import asyncio
import threading

import httpx

from gateway.app import create_app
from gateway.models import ServedModel


def test_prompts_are_tokenized_off_the_event_loop(redis_url, monkeypatch):
    """Completions, chat (a prompt past the window: its 400 comes back through the thread),
    /tokenize and Anthropic's count_tokens all tokenize on the preparing thread, not the loop's."""
    seen: list[str] = []
    for name in ("prompt_ids", "chat_ids"):
        original = getattr(ServedModel, name)

        def recorded(self, *args, _original=original, **kwargs):
            seen.append(threading.current_thread().name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(ServedModel, name, recorded)
    app = create_app(redis_url)
    long = "word " * 20_000  # past the 8,192-token window

    async def scenario() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                loop_thread = threading.current_thread().name
                replies = [
                    await client.post("/v1/completions", json={"prompt": long, "max_tokens": 4}),
                    await client.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": long}], "max_tokens": 4}),
                    await client.post("/tokenize", json={"prompt": "Hello there"}),
                    await client.post("/tokenize", json={
                        "messages": [{"role": "user", "content": "Hello"}]}),
                    await client.post("/v1/messages/count_tokens", json={
                        "model": "SmolLM2-135M-Instruct",
                        "messages": [{"role": "user", "content": "Hello"}]}),
                ]
                assert loop_thread not in seen
                return replies

    replies = asyncio.run(scenario())
    assert [r.status_code for r in replies] == [400, 400, 200, 200, 200], \
        [r.text[:200] for r in replies]
    assert "context window" in replies[0].json()["error"]["message"]
    assert replies[2].json()["count"] > 0 and replies[4].json()["input_tokens"] > 0
    assert len(seen) >= 5 and {name.split("_")[0] for name in seen} == {"shoal-prepare"}
