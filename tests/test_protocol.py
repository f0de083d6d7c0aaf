"""The wire format (shoal/messages.py): round trips, refusals, and readers that ignore fields
added by a newer build (rolling upgrades)."""

from __future__ import annotations

import msgpack
import pytest

from shoal.messages import (
    PROTOCOL_VERSION,
    IterationPlan,
    IterationResult,
    NewRequest,
    ProtocolError,
    TokenEvent,
    TokenEvents,
    TokenOutput,
    WorkerInfo,
    decode,
    encode,
)
from shoal.sampling_params import SamplingParams


def _plan() -> IterationPlan:
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop_token_ids=[2, 9])
    return IterationPlan(iteration=12, admit=[NewRequest("r1", [5, 6, 7], params, [8])],
                         run=["r0"], release=["r9"])


def _envelope(data: bytes) -> dict:
    return msgpack.unpackb(data)


def test_round_trip_keeps_nested_messages_and_params():
    plan = _plan()
    back = decode(encode(plan))
    assert back == plan
    assert isinstance(back.admit[0].params, SamplingParams) and back.admit[0].params.seed == 3


def test_token_events_round_trip_as_one_message():
    batch = TokenEvents([TokenEvent("a", 3, [17], [-0.5]),
                         TokenEvent("b", 0, [], finish_reason="error", error="gone",
                                    error_status=503),
                         TokenEvent("c", 1, [40], [-0.25], top_logprobs=[[[40, -0.25], [7, -1.5]]])])
    back = decode(encode(batch))
    assert back == batch and all(isinstance(e, TokenEvent) for e in back.events)
    result = IterationResult("w0", 4, [TokenOutput("c", 40, 1, -0.25, top_logprobs=[[40, -0.25]]),
                                       TokenOutput("d", 9, 0)], num_free_blocks=3)
    back = decode(encode(result))
    assert back == result and back.outputs[0].top_logprobs == [[40, -0.25]]
    assert "top_logprobs" not in _envelope(encode(result))["m"]["outputs"][1]  # None stays off


def test_fields_from_a_newer_build_are_ignored_at_every_level():
    env = _envelope(encode(_plan()))
    env["m"]["speculative_tokens"] = [1, 2]
    env["m"]["admit"][0]["priority_class"] = "gold"
    env["m"]["admit"][0]["params"]["typical_p"] = 0.9
    assert decode(msgpack.packb(env)) == _plan()
    info = WorkerInfo("w0", "m", 10, 4, 16, 8, 2048, heartbeat_at=1.5)
    env = _envelope(encode(info))
    env["m"]["gpu_name"] = "H100"
    assert decode(msgpack.packb(env)) == info


@pytest.mark.parametrize("change, needle", [
    (lambda e: e.update(v=PROTOCOL_VERSION + 1), "protocol version"),
    (lambda e: e.update(t="teleport"), "unknown message type"),
    (lambda e: e["m"].pop("admit"), "bad iteration_plan"),
    (lambda e: e["m"]["admit"][0].pop("prompt_token_ids"), "bad iteration_plan"),
    (lambda e: e["m"].update(admit=7), "bad iteration_plan"),
])
def test_incompatible_messages_are_refused(change, needle):
    env = _envelope(encode(_plan()))
    change(env)
    with pytest.raises(ProtocolError, match=needle):
        decode(msgpack.packb(env))
    with pytest.raises(ProtocolError, match="malformed"):
        decode(b"\xc1 not msgpack")


def test_scalar_fields_at_their_defaults_stay_off_the_wire_and_come_back():
    quiet = TokenEvent("a", 3, [17])
    final = TokenEvent("a", 4, [], finish_reason="length", prompt_tokens=5, completion_tokens=2)
    env = _envelope(encode(TokenEvents([quiet, final])))
    sent = env["m"]["events"]
    assert sent[0] == {"request_id": "a", "index": 3, "token_ids": [17], "logprobs": []}
    assert sent[1]["finish_reason"] == "length" and sent[1]["completion_tokens"] == 2
    assert "error" not in sent[1] and "error_status" not in sent[1]
    assert decode(msgpack.packb(env)) == TokenEvents([quiet, final])
    # Lists go out even when empty: older readers index some of them directly.
    assert _envelope(encode(IterationPlan(iteration=3)))["m"]["admit"] == []


def test_a_map_with_every_field_still_decodes():
    """What builds before the sparse maps sent (and `to_dict` still returns)."""
    plan = _plan()
    env = _envelope(encode(plan))
    env["m"] = plan.to_dict()
    assert decode(msgpack.packb(env)) == plan
