"""The HTTP server's transport rules, in process over a stand-in for the engines' client (no Ray, no engines): what a
web page can send is refused (content types, Host, Origin), tokens are checked strictly, every refusal is the JSON
error body, status codes follow the exception's type (a message saying "died" marks nothing dead), and a 500 never
carries the engine's internals. test_http_hostile.py repeats the reproductions against the real server and engines.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from arctic_rl.errors import (  # noqa: E402
    ConfigError,
    EngineDiedError,
    EngineError,
    EngineStateError,
    InvalidRequestError,
    WireFormatError,
)
from arctic_rl.http_api import ACCEPTED_CONTENT_TYPES, error_body, parse_arguments  # noqa: E402
from arctic_rl.http_client import _rebuild_error  # noqa: E402
from arctic_rl.http_guard import MIN_TOKEN_CHARS  # noqa: E402
from arctic_rl.serve import ServerSettings, create_app  # noqa: E402
from arctic_rl.wire import CONTENT_TYPE  # noqa: E402
from arctic_rl.wire_slots import SLOT_CONTENT_TYPE  # noqa: E402

TOKEN = "t" * MIN_TOKEN_CHARS
# What a Ray task error's text looks like: none of it may reach a client.
RAY_INTERNALS = 'ray::EngineActor.call() (pid=4242, ip=10.1.2.3, actor_id=8f3a0c)\n  File "/srv/engine.py", line 7'


class StandInClient:
    """The blocking client's surface that the server calls; ``fail`` makes the next call raise."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: BaseException | None = None

    def __getattr__(self, op: str) -> Any:
        def call(**arguments: Any) -> Any:
            self.calls.append(op)
            if self.fail is not None:
                raise self.fail
            return {"op": op, "arguments": sorted(arguments)}

        return call


@pytest.fixture
def stand_in() -> StandInClient:
    return StandInClient()


def make_http(client: StandInClient, base: str = "http://127.0.0.1:7000", **settings: Any) -> TestClient:
    app = create_app(client, ServerSettings(max_request_bytes=1 << 20, shared_memory=False, **settings))  # type: ignore[arg-type]
    return TestClient(app, base_url=base, raise_server_exceptions=False)


@pytest.fixture
def http(stand_in: StandInClient) -> Iterator[TestClient]:
    with make_http(stand_in) as client:
        yield client


def assert_error_body(response: Any, status: int, error: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert isinstance(body["error"], str) and len(body["message"]) > 20, body
    if error is not None:
        assert body["error"] == error, body
    return dict(body)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; b=x", ""],
)
def test_bodies_a_page_can_send_without_a_preflight_are_refused_before_parsing(
    http: TestClient, stand_in: StandInClient, content_type: str
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    for op in ("step", "shutdown", "save_checkpoint"):
        response = http.post(f"/v1/{op}", content=b"{}", headers=headers)
        assert_error_body(response, 415, "UnsupportedMediaType")
    assert stand_in.calls == []
    # JSON in any case and with parameters, the wire format and slot references still pass the guard.
    assert http.post("/v1/step", content=b"{}", headers={"Content-Type": "Application/JSON; charset=utf-8"}).json() == {
        "op": "step",
        "arguments": [],
    }
    assert {"application/json", CONTENT_TYPE, SLOT_CONTENT_TYPE} == ACCEPTED_CONTENT_TYPES
    with pytest.raises(WireFormatError, match="not parsed"):
        parse_arguments("step", "text/plain", b"{}", 1 << 20)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:7000", "10.0.0.9:7000", "", "127.0.0.1.evil.example"])
def test_a_host_header_naming_another_address_is_refused(stand_in: StandInClient, host: str) -> None:
    with make_http(stand_in) as http:
        for method, path in (("GET", "/health"), ("GET", "/v1/describe"), ("POST", "/v1/step")):
            response = http.request(method, path, headers={"Host": host, "Content-Type": "application/json"})
            assert_error_body(response, 421, "MisdirectedRequest")
    assert stand_in.calls == []


@pytest.mark.parametrize("host", ["127.0.0.1:7000", "localhost:7000", "LOCALHOST", "[::1]:7000", "127.0.0.5"])
def test_loopback_names_are_accepted(stand_in: StandInClient, host: str) -> None:
    with make_http(stand_in) as http:
        assert http.get("/health", headers={"Host": host}).status_code == 200


def test_the_bound_address_and_allowed_names_pass_and_a_wildcard_bind_takes_any_name(stand_in: StandInClient) -> None:
    with make_http(stand_in, host="10.0.0.5", token=TOKEN, allowed_hosts=("rl.internal",)) as http:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for host in ("10.0.0.5:7000", "rl.internal:7000", "localhost"):
            assert http.get("/health", headers={"Host": host, **auth}).status_code == 200
        assert_error_body(http.get("/health", headers={"Host": "other.internal", **auth}), 421)
    with make_http(stand_in, host="0.0.0.0", token=TOKEN) as http:
        assert http.get("/health", headers={"Host": "any.name", "Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:8000", "https://127.0.0.1:7000"])
def test_cross_origin_requests_are_refused_token_or_not(stand_in: StandInClient, origin: str) -> None:
    for settings in ({}, {"token": TOKEN}):
        with make_http(stand_in, **settings) as http:
            headers = {"Origin": origin, "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
            assert_error_body(http.post("/v1/step", content=b"{}", headers=headers), 403, "CrossOriginRequest")
            assert_error_body(http.get("/v1/describe", headers=headers), 403)
    assert stand_in.calls == []
    # The server's own origin (its /docs page) is not cross-origin.
    with make_http(stand_in) as http:
        same = {"Origin": "http://127.0.0.1:7000", "Content-Type": "application/json"}
        assert http.post("/v1/step", content=b"{}", headers=same).status_code == 200


def test_the_token_is_checked_strictly(stand_in: StandInClient) -> None:
    with make_http(stand_in, token=TOKEN) as http:
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert http.get("/health", headers={"Authorization": f"{scheme} {TOKEN}"}).status_code == 200
        for value in ("", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", "Bearer"):
            assert_error_body(http.get("/health", headers={"Authorization": value}), 401, "Unauthorized")
        twice = [("Authorization", f"Bearer {TOKEN}"), ("Authorization", "Bearer wrong")]
        assert_error_body(http.get("/health", headers=twice), 400, "Unauthorized")
        assert_error_body(http.get("/health", headers=list(reversed(twice))), 400, "Unauthorized")


def test_a_short_token_is_refused_beyond_loopback() -> None:
    with pytest.raises(ConfigError, match=f"at least {MIN_TOKEN_CHARS}"):
        ServerSettings(host="0.0.0.0", token="x" * (MIN_TOKEN_CHARS - 1))
    with pytest.raises(ConfigError, match="--token-file"):
        ServerSettings(host="10.0.0.5")
    ServerSettings(host="0.0.0.0", token="x" * MIN_TOKEN_CHARS)
    ServerSettings(host="127.0.0.1", token="short")


def test_unknown_paths_and_methods_get_the_json_error_body(http: TestClient) -> None:
    assert_error_body(http.get("/v1/no_such_operation"), 404, "NotFound")
    assert_error_body(http.get("/v1/step"), 405, "MethodNotAllowed")
    assert http.get("/v1/step").headers["allow"] == "POST"
    assert_error_body(http.post("/v1/weight_norm", json={}), 405, "MethodNotAllowed")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"step": "1"}, "step"),
        ({"step": 1.0}, "step"),
        ({"step": True}, "step"),
        ({"path": 5}, "path"),
    ],
)
def test_values_are_not_coerced(http: TestClient, stand_in: StandInClient, body: dict[str, Any], field: str) -> None:
    error = assert_error_body(http.post("/v1/load_checkpoint", json=body), 422, "ConfigError")
    assert field in error["message"]
    assert stand_in.calls == []


@pytest.mark.parametrize(
    "body",
    [
        {"prompts": [[True]], "sampling_params": {}},
        {"prompts": [[1.0]], "sampling_params": {}},
        {"prompts": ["a", [1]], "sampling_params": {}},
        {"prompts": [], "sampling_params": {}},
    ],
)
def test_prompts_are_not_coerced(http: TestClient, stand_in: StandInClient, body: dict[str, Any]) -> None:
    assert_error_body(http.post("/v1/generate", json=body), 422, "ConfigError")
    assert stand_in.calls == []


@pytest.mark.parametrize(
    "processing",
    [["grpo"], "grpo", {"loss_fn": ["grpo"]}, {"loss_fn": {"a": 1}}, {"config": []}, {"config": "x"}, {"x": 1}],
)
def test_a_malformed_processing_is_a_422(http: TestClient, stand_in: StandInClient, processing: Any) -> None:
    for op in ("fwd_bwd", "train_step"):
        response = http.post(f"/v1/{op}", json={"batch": {}, "processing": processing})
        assert "processing" in assert_error_body(response, 422, "ConfigError")["message"]
    assert stand_in.calls == []


def test_status_follows_the_exception_type_never_its_message(http: TestClient, stand_in: StandInClient) -> None:
    # A failed call whose message says "died" (the path names it) is a failed call: 500, nothing marked dead.
    stand_in.fail = EngineError("training[0]", "load_checkpoint() failed: no file /data/who-died-here/latest")
    error = assert_error_body(http.post("/v1/load_checkpoint", json={"path": "/data/who-died-here"}), 500)
    assert error["error"] == "EngineError" and error["engine"] == "training[0]"
    assert "load_checkpoint" in error["message"] and "log" in error["message"]
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["engine_errors"] == {}

    stand_in.fail = InvalidRequestError("sampling_params.seed", "must be an integer in [0, 2**63), got 'x'")
    error = assert_error_body(http.post("/v1/generate", json={"prompts": [[1]], "sampling_params": {}}), 422)
    assert (error["error"], error["field"]) == ("InvalidRequestError", "sampling_params.seed")
    stand_in.fail = EngineStateError("fwd_bwd needs the training engine awake", engine="training")
    assert_error_body(http.post("/v1/step", json={}), 409, "EngineStateError")
    assert http.get("/health").status_code == 200

    stand_in.fail = EngineDiedError("sampling[0]", "its actor process died (RayActorError)")
    error = assert_error_body(http.get("/v1/weight_norm"), 503, "EngineDiedError")
    assert error["engine"] == "sampling[0]"
    health = http.get("/health")
    assert health.status_code == 503 and list(health.json()["engine_errors"]) == ["sampling[0]"]


@pytest.mark.parametrize(
    "failure",
    [
        EngineError("training[0]", f"failed: {RAY_INTERNALS}"),
        TypeError(f"unhashable type: 'list'\n{RAY_INTERNALS}"),
        RuntimeError(RAY_INTERNALS),
    ],
)
def test_a_500_names_the_operation_and_keeps_internals_in_the_log(
    http: TestClient, stand_in: StandInClient, failure: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    stand_in.fail = failure
    response = http.post("/v1/fwd_bwd", json={"batch": {}, "processing": None})
    error = assert_error_body(response, 500)
    for secret in ("pid=4242", "10.1.2.3", "8f3a0c", "/srv/engine.py", "File "):
        assert secret not in response.text
    assert "fwd_bwd" in error["message"]
    assert "pid=4242" in caplog.text, "the details belong in the server's log"
    assert http.get("/health").status_code == 200


def test_the_client_rebuilds_each_error_type() -> None:
    request = httpx.Request("POST", "http://127.0.0.1:7000/v1/generate")
    for error in (
        InvalidRequestError("prompts[0][1]", "token id 70000 is outside the vocabulary [0, 300)"),
        EngineDiedError("training[0]", "its actor process died (RayActorError)"),
        EngineError("training[0]", "load_checkpoint() failed"),
    ):
        status, body = error_body(error, "generate")
        rebuilt = _rebuild_error(
            "generate", "http://127.0.0.1:7000", httpx.Response(status, json=body, request=request)
        )
        assert type(rebuilt) is type(error)
        assert rebuilt.__reduce__()[1][0] == error.__reduce__()[1][0]
    for status in (403, 415, 421):
        response = httpx.Response(status, json={"error": "X", "message": "refused"}, request=request)
        assert isinstance(_rebuild_error("generate", "http://x", response), ConfigError)
