"""Issue #38's transport reproductions against the real server: ``python -m arctic_rl.serve`` on 127.0.0.1 with the
real engines on the CPU (tiny Qwen3, trainer and sampler on separate workers, ZoRRO and FCA on), one server for the
module, started with its own Ray instance as a user would start it.

A web page's requests (text/plain and form bodies, a foreign Host as after DNS rebinding, a cross-origin POST) are
refused and change nothing; malformed values that gave 500s get a 4xx; a checkpoint path naming "died" marks no
engine dead; a flood of small upload slots is bounded (429) while the server keeps answering, and a client that is
refused a slot sends the body; protocol errors are JSON. Last, SIGTERM ends the server promptly, and every process
it started (engines, Ray's own) is gone within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("deepspeed")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from test_end_to_end import CPU_SLOTS, PAD, PROMPTS, make_config  # noqa: E402

from arctic_rl import ArcticRLClientConfig, SyncArcticRLClient, build_grpo_batch, create_arctic_rl_client  # noqa: E402
from arctic_rl.errors import ArcticRLError, EngineDiedError, InvalidRequestError  # noqa: E402
from arctic_rl.http_client import LocalServer  # noqa: E402
from arctic_rl.testing import save_tiny_qwen3  # noqa: E402
from arctic_rl.wire_slots import SLOT_CONTENT_TYPE  # noqa: E402

pytestmark = pytest.mark.slow

SAMPLING = {"n": 2, "max_tokens": 4, "seed": 7, "temperature": 1.0}
# What a remote traceback carries; none of it may reach a client.
INTERNALS = ("pid=", "ip=", "actor_id", "Traceback", 'File "')


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RealServer:
    def __init__(self, local: LocalServer, config: ArcticRLClientConfig, tmp: Path) -> None:
        self.local = local
        self.config = config
        self.tmp = tmp
        self.url = f"http://127.0.0.1:{config.port}"

    def client(self) -> SyncArcticRLClient:
        attached = self.config.model_copy(update={"launch_local_server": False})
        client = create_arctic_rl_client(attached, blocking_calls=True)
        assert isinstance(client, SyncArcticRLClient)
        return client


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    tmp = tmp_path_factory.mktemp("hostile")
    model_dir = save_tiny_qwen3(tmp / "tiny-qwen3", seed=3)
    fields = make_config(model_dir, colocate=False, zorro=True, checkpoint_path=tmp / "checkpoints").model_dump()
    # No ray_address: the server starts (and must stop) its own Ray instance.
    fields.update(comm_protocol="http", launch_local_server=True, port=free_port())
    config = ArcticRLClientConfig.model_validate(fields)
    local = LocalServer.start(config, placement_overrides=CPU_SLOTS)
    try:
        local.wait_ready(f"http://127.0.0.1:{config.port}", {}, timeout_s=900)
        yield RealServer(local, config, tmp)
    finally:
        if local.process.poll() is None:
            os.killpg(local.process.pid, signal.SIGKILL)
            local.process.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server: RealServer) -> Iterator[SyncArcticRLClient]:
    attached = server.client()
    try:
        yield attached
    finally:
        attached.shutdown()


def state(client: SyncArcticRLClient) -> tuple[Any, ...]:
    """What must not change: the weights of both engines, the step, and a fixed-seed generate."""
    norms = client.weight_norm()
    samples = client.generate(PROMPTS[:1], SAMPLING)
    return norms["training_norm"], norms["sampling_norm"], client.describe()["step"], samples


def grpo_batch(client: SyncArcticRLClient) -> dict[str, Any]:
    samples = client.generate(PROMPTS, {**SAMPLING, "n": 4})
    batch = build_grpo_batch(PROMPTS, samples, [[0.0, 1.0, 0.5, 0.25]] * len(PROMPTS), pad_token_id=PAD)
    batch.pop("prompts")
    return batch


def assert_error_body(response: httpx.Response, status: int, error: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert isinstance(body["error"], str) and len(body["message"]) > 20, body
    assert error is None or body["error"] == error, body
    assert not any(secret in response.text for secret in INTERNALS), response.text
    return dict(body)


def test_what_a_web_page_can_send_is_refused_and_changes_nothing(
    server: RealServer, client: SyncArcticRLClient
) -> None:
    before = state(client)
    step = f"{server.url}/v1/step"
    # The simple requests a page sends cross-origin without a preflight: a text/plain or form body, or none.
    for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", None):
        headers = {} if content_type is None else {"Content-Type": content_type}
        assert_error_body(httpx.post(step, content=b"{}", headers=headers), 415, "UnsupportedMediaType")
    page = "http://evil.example"
    json_headers = {"Content-Type": "application/json"}
    assert_error_body(httpx.post(step, json={}, headers={"Origin": page}), 403, "CrossOriginRequest")
    # After DNS rebinding the page is same-origin under its own name: the Host header gives it away.
    rebound = {"Host": "evil.example:80", "Origin": "http://evil.example:80", **json_headers}
    assert_error_body(httpx.post(step, content=b"{}", headers=rebound), 421, "MisdirectedRequest")
    assert_error_body(httpx.get(f"{server.url}/v1/describe", headers={"Host": "evil.example"}), 421)
    assert state(client) == before


def test_the_issues_500s_are_4xx_and_protocol_errors_are_json(server: RealServer, client: SyncArcticRLClient) -> None:
    before = state(client)
    batch = grpo_batch(client)
    for processing in ({"loss_fn": ["grpo"]}, {"loss_fn": {"grpo": 1}}, {"config": ["x"]}, {"config": "x"}):
        with pytest.raises(ArcticRLError, match="processing") as refused:
            client.fwd_bwd(batch, processing)
        assert type(refused.value).__name__ == "ConfigError"
    reference = {"slot": "arctic-rl-slot-" + "0" * 32, "nonce": "\u00e9" * 32, "size": 64}
    response = httpx.post(
        f"{server.url}/v1/fwd_no_grad", content=json.dumps(reference), headers={"Content-Type": SLOT_CONTENT_TYPE}
    )
    assert_error_body(response, 400, "WireFormatError")
    load = f"{server.url}/v1/load_checkpoint"
    assert "step" in assert_error_body(httpx.post(load, json={"step": "1"}), 422, "ConfigError")["message"]
    assert_error_body(httpx.get(f"{server.url}/v1/nothing_here"), 404, "NotFound")
    assert_error_body(httpx.get(f"{server.url}/v1/step"), 405, "MethodNotAllowed")
    with socket.create_connection(("127.0.0.1", server.config.port), timeout=10) as raw:
        raw.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b""
        while chunk := raw.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head.lower(), answer
    assert json.loads(body)["error"] == "BadRequest"
    assert state(client) == before


def test_a_checkpoint_path_naming_died_marks_no_engine_dead(server: RealServer, client: SyncArcticRLClient) -> None:
    before = state(client)
    for op, body in (
        ("load_checkpoint", {"path": str(server.tmp / "who-died-here")}),
        ("load_checkpoint", {"path": str(server.tmp / "who-died-here"), "step": 3}),
        ("save_checkpoint", {"path": "/proc/who-died-here"}),
    ):
        response = httpx.post(f"{server.url}/v1/{op}", json=body, timeout=120)
        # The user's mistake, refused before DeepSpeed sees the path: 422 naming the field, never 503.
        assert assert_error_body(response, 422, "InvalidRequestError")["field"] in ("path", "step")
        with pytest.raises(InvalidRequestError) as raised:
            if op == "load_checkpoint":
                client.load_checkpoint(body["path"])
            else:
                client.save_checkpoint(body["path"])
        assert not isinstance(raised.value, EngineDiedError)
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "engine_errors": {}, "busy": False}
    assert state(client) == before


def open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_small_slots_is_bounded_and_the_server_keeps_answering(
    server: RealServer, client: SyncArcticRLClient
) -> None:
    pid = server.local.process.pid
    descriptors = open_descriptors(pid)
    slots_url = f"{server.url}/v1/wire_slots"
    answers = [httpx.post(slots_url, json={"size": 16}) for _ in range(200)]
    statuses = [answer.status_code for answer in answers]
    granted = statuses.count(201)
    assert 1 <= granted <= 16 and statuses[granted:] == [429] * (200 - granted), statuses
    refused = answers[-1]
    assert 1 <= int(refused.headers["Retry-After"]) <= 120 and "slot" in refused.json()["message"]
    assert open_descriptors(pid) <= descriptors + granted + 8
    assert httpx.get(f"{server.url}/health").status_code == 200
    # A client refused a slot (429) sends the batch as the body and gets the same answer.
    batch = grpo_batch(client)
    http = server.config.http.model_copy(update={"shared_memory_min_bytes": 0})
    with create_arctic_rl_client(
        server.config.model_copy(update={"launch_local_server": False, "http": http}), blocking_calls=True
    ) as slotted:
        assert isinstance(slotted, SyncArcticRLClient)
        through_slot_attempt = slotted.fwd_no_grad(batch)
    body = client.fwd_no_grad(batch)
    assert set(through_slot_attempt) == set(body)
    for key in body:
        assert through_slot_attempt[key].equal(body[key])


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Ray's own processes and the engines' workers included)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state_letter = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state_letter != "Z"


def test_sigterm_ends_the_server_and_every_process_it_started(server: RealServer, client: SyncArcticRLClient) -> None:
    pid = server.local.process.pid
    engines = {engine["pid"] for engine in client.describe()["engines"].values()}
    started = descendants(pid)
    assert engines <= started, (engines, started)
    assert any("raylet" in Path(f"/proc/{child}/cmdline").read_text() for child in started if alive(child))
    began = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    code = server.local.process.wait(timeout=60)
    ended_s = time.monotonic() - began
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(child) for child in started):
        time.sleep(0.1)
    gone_s = time.monotonic() - began
    lingering = {child: Path(f"/proc/{child}/cmdline").read_bytes()[:80] for child in started if alive(child)}
    assert lingering == {}, lingering
    print(
        f"SIGTERM: the server exited after {ended_s:.1f} s, the {len(started)} processes it started were gone after "
        f"{gone_s:.1f} s"
    )
    assert code == 128 + signal.SIGTERM, (code, server.local.log_tail())
    assert ended_s < 30
