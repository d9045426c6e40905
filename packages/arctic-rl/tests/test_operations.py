"""The operation table (arctic_rl.operations) is the one definition: both clients, the HTTP routes and bodies, and
the service agree with it. In process, without Ray or engines: the clients run over a recording transport, the
server over a blocking client on that transport."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from arctic_rl.client import ArcticRLClient, SyncArcticRLClient
from arctic_rl.config import ArcticRLClientConfig
from arctic_rl.errors import InvalidRequestError
from arctic_rl.http_api import API_PREFIX
from arctic_rl.operations import OPERATIONS, Operation
from arctic_rl.service import RLService

# A value of each required argument (the rest keep their defaults); the server's body models must accept them.
REQUIRED_VALUES: dict[str, Any] = {
    "prompts": ["a prompt"],
    "sampling_params": {"max_tokens": 2},
    "batch": {"input_ids": [[1, 2, 3]]},
    "completions": ["a completion"],
}


# Ray adds this keyword to every method of a class once it is made an actor (its tracing hook), in place: the
# service class looks different after any test in the same process has started it as a Ray actor.
RAY_TRACING_PARAMETER = "_ray_trace_ctx"


def _parameters(function: Any) -> dict[str, tuple[inspect._ParameterKind, Any]]:
    signature = inspect.signature(function)
    return {
        name: (parameter.kind, parameter.default)
        for name, parameter in signature.parameters.items()
        if name not in ("self", RAY_TRACING_PARAMETER)
    }


def _body_parameters(operation: Operation[Any]) -> dict[str, Any]:
    return {
        name: inspect.Parameter.empty if field.is_required() else field.get_default()
        for name, field in operation.body.model_fields.items()
    }


def _arguments(operation: Operation[Any]) -> dict[str, Any]:
    return {
        name: REQUIRED_VALUES[name] if field.is_required() else field.get_default()
        for name, field in operation.body.model_fields.items()
    }


class RecordingTransport:
    """Records each call and answers with a value that names it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.closed = False

    async def call(self, op: str, arguments: dict[str, Any]) -> Any:
        return self.call_sync(op, arguments)

    def call_sync(self, op: str, arguments: dict[str, Any]) -> Any:
        self.calls.append((op, dict(arguments)))
        return {"answered": op}

    async def close(self) -> None:
        self.closed = True

    def close_sync(self) -> None:
        self.closed = True


@pytest.mark.parametrize("client_class", [ArcticRLClient, SyncArcticRLClient])
def test_every_operation_is_a_client_method_whose_parameters_are_the_body_fields(client_class: type) -> None:
    for name, operation in OPERATIONS.items():
        assert operation.name == name
        method = getattr(client_class, name)
        parameters = _parameters(method)
        assert {key: default for key, (_, default) in parameters.items()} == _body_parameters(operation), name


@pytest.mark.parametrize("blocking", [False, True])
def test_each_client_method_sends_its_own_operation_with_every_argument(blocking: bool) -> None:
    transport = RecordingTransport()
    client = SyncArcticRLClient(transport) if blocking else ArcticRLClient(transport)
    for name, operation in OPERATIONS.items():
        if name == "shutdown":
            continue
        arguments = _arguments(operation)
        sent = operation.arguments(arguments)
        answer = getattr(client, name)(**arguments)
        if not blocking:
            answer = asyncio.run(answer)
        assert transport.calls[-1] == (name, sent), name
        if name.startswith(("sleep_", "wake_", "empty_", "reset_")):
            assert answer is None, name
        else:
            assert answer == {"answered": name}, name
        # Arguments added later are sent only when set, so servers from before them answer the plain call.
        assert set(arguments) - set(sent) == set(operation.sent_when_set), name
    (client.shutdown() if blocking else asyncio.run(client.shutdown()))  # type: ignore[union-attr]
    assert transport.closed


def test_a_flag_sent_only_when_set_goes_out_when_set_even_as_a_wrong_type() -> None:
    transport = RecordingTransport()
    client = SyncArcticRLClient(transport)
    client.fwd_bwd({"input_ids": [[1]]}, old_log_probs_from_forward=True)
    assert transport.calls[-1][1]["old_log_probs_from_forward"] is True
    # 0 is not False: the service must see it (and refuse it), not a silently dropped flag.
    client.fwd_bwd({"input_ids": [[1]]}, old_log_probs_from_forward=0)  # type: ignore[arg-type]
    assert transport.calls[-1][1]["old_log_probs_from_forward"] == 0


def test_the_server_has_one_route_per_operation_that_forwards_its_body() -> None:
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from arctic_rl.serve import ServerSettings, create_app

    transport = RecordingTransport()
    app = create_app(SyncArcticRLClient(transport), ServerSettings(shared_memory=False))
    routes = {
        route.path: set(route.methods)  # type: ignore[attr-defined]
        for route in app.routes
        # The server's own endpoints (upload slots, status) are not operations.
        if route.path.startswith(API_PREFIX) and route.path not in (f"{API_PREFIX}/wire_slots", f"{API_PREFIX}/status")  # type: ignore[attr-defined]
    }
    assert routes == {f"{API_PREFIX}/{name}": {operation.method} for name, operation in OPERATIONS.items()}
    with TestClient(app, base_url="http://127.0.0.1:7000", raise_server_exceptions=True) as http:
        for name, operation in OPERATIONS.items():
            if name in ("shutdown", "fwd_no_grad"):
                # shutdown closes the transport; fwd_no_grad answers in the wire format (its routing is the same).
                continue
            arguments = _arguments(operation)
            if operation.method == "GET":
                response = http.get(f"{API_PREFIX}/{name}")
                arguments = {}
            else:
                response = http.post(f"{API_PREFIX}/{name}", json=arguments)
            assert response.status_code == 200, (name, response.text)
            assert transport.calls[-1] == (name, operation.arguments(arguments)), name


def test_the_service_serves_exactly_the_table_with_the_same_parameters() -> None:
    for name, operation in OPERATIONS.items():
        parameters = _parameters(getattr(RLService, name))
        assert {key: default for key, (_, default) in parameters.items()} == _body_parameters(operation), name
        # The same parameter kinds as the clients': one call reads the same on both sides of the transport.
        assert parameters == _parameters(getattr(SyncArcticRLClient, name)), name
    service = RLService(ArcticRLClientConfig(model_name="fake", device="cpu", training_gpus=1, sampling_gpus=1))
    served: list[tuple[str, dict[str, Any]]] = []
    for name in OPERATIONS:
        setattr(service, name, lambda _name=name, **arguments: served.append((_name, arguments)))
    for name, operation in OPERATIONS.items():
        service.run(name, _arguments(operation))
    assert served == [(name, _arguments(operation)) for name, operation in OPERATIONS.items()]
    with pytest.raises(InvalidRequestError, match="not an arctic-rl operation"):
        service.run("dead_engines", {})


def test_a_temperature_other_than_1_travels_from_the_client_through_http_to_the_service() -> None:
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from arctic_rl.serve import ServerSettings, create_app

    transport = RecordingTransport()
    client = SyncArcticRLClient(transport)
    client.fwd_no_grad({"input_ids": [[1]]}, temperature=0.7)
    client.fwd_bwd({"input_ids": [[1]]}, temperature=0.7)
    client.train_step({"input_ids": [[1]]}, temperature=0.7)
    client.log_probs(["a"], ["b"], temperature=0.7)
    assert [arguments["temperature"] for _, arguments in transport.calls] == [0.7] * 4
    server_side = RecordingTransport()
    app = create_app(SyncArcticRLClient(server_side), ServerSettings(shared_memory=False))
    with TestClient(app, base_url="http://127.0.0.1:7000") as http:
        for op, arguments in transport.calls[1:]:
            assert http.post(f"{API_PREFIX}/{op}", json=arguments).status_code == 200, op
        refused = http.post(f"{API_PREFIX}/fwd_bwd", json={"batch": {}, "temperature": 0})
        assert refused.status_code == 422 and "temperature" in refused.json()["message"]
    assert server_side.calls == transport.calls[1:]
