"""The served deployment's allow-list (issue 55, part 4): a caller of ``laminar serve``'s deployment may
set only keys that cannot name a host path or a URL, and the served API answers 403 with the reason
to a request that tries (``tasks.served_server.ParameterGuard``, driven here as the ASGI app it is;
the real server: tests/reliability/test_lockdown.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tasks.served_server import ParameterGuard
from tasks.serving import ServeError, caller_keys, check_caller_override, refused_parameters

SPEC = {"workspace": "/srv/ws", "overrides": ["data=math", "rollout.vllm_python=/opt/vllm/bin/python"]}


def _call(method: str, path: str, body: object) -> tuple[int, dict, bool]:
    """(status, JSON body, whether the app behind the guard was reached) of one request."""
    reached = []

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message["body"], message["more_body"]
        reached.append(json.loads(body))
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    raw = json.dumps(body).encode()
    chunks = [raw[: len(raw) // 2], raw[len(raw) // 2 :]]  # a body in two messages
    sent: list[dict] = []

    async def receive():
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(ParameterGuard(app, SPEC)(scope, receive, send))
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(payload), bool(reached)


@pytest.mark.parametrize(
    "path",
    ["/api/deployments/d1/create_flow_run", "/api/flow_runs/", "/api/deployments/d1", "/api/flow_runs/f1"],
)
def test_the_served_api_refuses_a_path_or_url_override_with_403_and_the_reason(path):
    method = "PATCH" if path.endswith(("d1", "f1")) else "POST"
    status, body, reached = _call(
        method, path, {"parameters": {"overrides": ["tracking.mlflow_uri=sqlite:////any/path.db"]}}
    )
    assert (status, reached) == (403, False)
    assert "tracking.mlflow_uri is not among the keys a run's caller may set" in body["detail"]
    status, body, reached = _call(method, path, {"parameters": {"workspace": "/elsewhere"}})
    assert (status, reached) == (403, False) and "runs on workspace /srv/ws only" in body["detail"]


def test_the_served_api_passes_allowed_parameters_and_other_requests_through():
    ok = {
        "parameters": {"overrides": ["data=math", "rollout.vllm_python=/opt/vllm/bin/python", "rl.lr=3e-4"]}
    }
    assert _call("POST", "/api/deployments/d1/create_flow_run", ok)[::2] == (201, True)
    assert _call("POST", "/api/deployments/d1/create_flow_run", {})[::2] == (201, True)  # the defaults
    bad = {"parameters": {"overrides": ["model.path=/etc"]}}
    assert _call("POST", "/api/logs/", bad)[::2] == (201, True)  # not a deployment or flow run


@pytest.mark.parametrize(
    "override",
    [
        "tracking.mlflow_uri=sqlite:////any/path.db",
        "eval.benchmarks=[{name: x, path: /etc/passwd}]",
        "eval.benchmarks=[gsm8k, ../../etc/passwd]",
        "curation.decontam.benchmarks=['/etc/passwd']",
        "reward.components=[{name: code_tests}]",
        "tracking.backends=[mlflow]:x",
        "sandbox.allow_unsafe=true",
        "sandbox.limits.memory_mb=1000000",
        "rl.mode=${oc.env:HOME}",
        "model=../../x",
        "hydra.searchpath=[file:///tmp]",
    ],
)
def test_a_caller_may_not_set_a_key_that_can_name_a_host_path_url_or_the_sandbox(override):
    with pytest.raises(ServeError, match="refused|unknown config key"):
        check_caller_override(override)
    assert refused_parameters({"overrides": [override]}, SPEC)


def test_the_allow_list_holds_numbers_switches_and_names_and_no_free_string():
    keys = caller_keys()
    assert {"rl.lr", "seed", "rl.mode", "data.levels", "eval.benchmarks", "data.allow_empty"} <= set(keys)
    for free in (
        "tracking.mlflow_uri",
        "model.path",
        "rollout.vllm_python",
        "trainer.deepspeed",
        "cluster.address",
    ):
        assert free not in keys
    assert not any(k.startswith(("sandbox.", "data.sources", "reward.components")) for k in keys)
    for override in (
        "rl.lr=3e-4",
        "seed=3",
        "rl.mode=laminar",
        "eval.benchmarks=[gsm8k,math500]",
        "data=math",
    ):
        check_caller_override(override)
