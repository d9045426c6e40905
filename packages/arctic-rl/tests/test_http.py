"""The HTTP transport on a local Ray with the small fake engines (fake_engines.py): the server forwards to the same
service as the Ray client and answers with the same results and exceptions (and so does the async client over Ray);
malformed requests of every endpoint get a 4xx and change nothing (hypothesis), and so do bad shared-memory slots;
batches through shared-memory slots equal the body's bitwise, a server without slots gets the body, and slots leave
nothing open; a non-loopback server needs its bearer token; oversize bodies get 413; a launched server stops at
shutdown, a killed one gives the client a clear error, and an engine killed under the server is named by a 503 and by
/health."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from fake_engines import VOCAB  # noqa: E402
from http_helpers import ServerThread, free_port  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from ray_helpers import retry_start  # noqa: E402
from slot_helpers import memfd_slots, shm_files  # noqa: E402

from arctic_rl.batch import build_grpo_batch, validate_batch  # noqa: E402
from arctic_rl.client import (  # noqa: E402
    ArcticRLClient,
    SyncArcticRLClient,
    attach_arctic_rl_client,
    create_arctic_rl_client,
)
from arctic_rl.config import ArcticRLClientConfig  # noqa: E402
from arctic_rl.errors import (  # noqa: E402
    ArcticRLError,
    BatchValidationError,
    ConfigError,
    EngineDiedError,
    EngineError,
    EngineStateError,
    TransportError,
    WireFormatError,
)
from arctic_rl.http_api import OPERATIONS, parse_arguments  # noqa: E402
from arctic_rl.serve import ServerSettings, create_app  # noqa: E402
from arctic_rl.wire import CONTENT_TYPE, encode_message, plan_message  # noqa: E402
from arctic_rl.wire_slots import SLOT_CONTENT_TYPE, write_to_slot  # noqa: E402

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
FAKES = {
    "training": "fake_engines:FakeTrainingEngine",
    "log_prob": "fake_engines:FakeTrainingEngine",
    "sampling": "fake_engines:FakeSamplingEngine",
}
CPU_SLOTS = {"cpus_per_cpu_worker": 0.25}
PROMPTS = [[1, 2, 3], [4, 5]]
MAX_REQUEST_BYTES = 1 << 20


def http_config(port: int, **overrides: Any) -> ArcticRLClientConfig:
    fields: dict[str, Any] = {
        "model_name": "fake-bigram",
        "device": "cpu",
        "training_gpus": 1,
        "sampling_gpus": 1,
        "training": {"lr": 0.5},
        "comm_protocol": "http",
        "port": port,
        "http": {"retries": 2, "backoff_s": 0.05, "connect_timeout_s": 2.0, "request_timeout_s": 120.0},
    }
    fields.update(overrides)
    return ArcticRLClientConfig(**fields)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # Engine actors and launched servers import fake_engines from this folder: both inherit PYTHONPATH.
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), previous]))
    retry_start(lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="arctic_rl_http"))
    try:
        yield
    finally:
        ray.shutdown()
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous


@pytest.fixture(scope="module")
def ray_client(local_ray: None) -> Iterator[SyncArcticRLClient]:
    config = http_config(7000, comm_protocol="ray")
    client = create_arctic_rl_client(
        config, blocking_calls=True, engine_classes=FAKES, placement_overrides=CPU_SLOTS, service_name="http_tests"
    )
    assert isinstance(client, SyncArcticRLClient)
    try:
        yield client
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def server(ray_client: SyncArcticRLClient) -> Iterator[ServerThread]:
    running = ServerThread(create_app(ray_client, ServerSettings(max_request_bytes=MAX_REQUEST_BYTES)))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def http_client(server: ServerThread) -> Iterator[SyncArcticRLClient]:
    client = create_arctic_rl_client(http_config(server.port), blocking_calls=True)
    assert isinstance(client, SyncArcticRLClient)
    try:
        yield client
    finally:
        client.shutdown()


def make_batch(client: SyncArcticRLClient) -> dict[str, torch.Tensor]:
    samples = client.generate(PROMPTS, {"n": 2, "max_tokens": 3, "seed": 1})
    rewards = torch.rand(len(PROMPTS), 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return build_grpo_batch(PROMPTS, samples, rewards.tolist(), pad_token_id=0)


def assert_same(left: Any, right: Any) -> None:
    assert type(left) is type(right), (type(left), type(right))
    if isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype and torch.equal(left, right)
    elif isinstance(left, dict):
        assert sorted(left) == sorted(right)
        for key in left:
            assert_same(left[key], right[key])
    elif isinstance(left, list):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            assert_same(a, b)
    else:
        assert left == right


def test_http_answers_equal_ray_answers(ray_client: SyncArcticRLClient, http_client: SyncArcticRLClient) -> None:
    sampling = {"n": 2, "max_tokens": 3, "seed": 4}
    assert_same(http_client.generate(PROMPTS, sampling), ray_client.generate(PROMPTS, sampling))
    batch = make_batch(http_client)
    assert_same(http_client.fwd_no_grad(batch, calculate_entropy=True), ray_client.fwd_no_grad(batch, False, True))
    assert_same(http_client.weight_norm(), ray_client.weight_norm())
    assert_same(http_client.describe(), ray_client.describe())
    before = ray_client.describe()["step"]
    result = http_client.fwd_bwd(batch, {"loss_fn": "grpo", "config": {}})
    assert isinstance(result["loss"], float) and isinstance(result["metrics"], dict)
    stepped = http_client.step()
    assert stepped["step"] == before + 1 == ray_client.describe()["step"]
    assert_same(http_client.last_step_metrics(), ray_client.last_step_metrics())
    assert http_client.sync_weights()["time_s"] >= 0
    norms = http_client.weight_norm()
    assert norms == ray_client.weight_norm() and norms["sampling_norm"] == pytest.approx(norms["training_norm"])
    assert http_client.empty_training_cache() is None and http_client.reset_prefix_cache() is None
    # fwd_bwd + step + sync in one request, old log-probs from the training forward: the wire carries both flags.
    trained = http_client.train_step(
        batch, {"loss_fn": "grpo", "config": {}}, old_log_probs_from_forward=True, sync_weights=True
    )
    assert sorted(trained) == ["fwd_bwd", "step", "sync_weights"]
    assert trained["step"]["step"] == before + 2 == ray_client.describe()["step"]
    assert trained["step"]["metrics"]["time/sync"] > 0 and trained["sync_weights"]["time_s"] > 0
    assert_same(http_client.last_step_metrics(), ray_client.last_step_metrics())
    norms = http_client.weight_norm()
    assert norms == ray_client.weight_norm() and norms["sampling_norm"] == pytest.approx(norms["training_norm"])


def test_the_async_client_gives_the_same_answers(ray_client: SyncArcticRLClient, server: ServerThread) -> None:
    batch = make_batch(ray_client)
    client = create_arctic_rl_client(http_config(server.port))
    assert isinstance(client, ArcticRLClient)

    async def run() -> tuple[Any, Any]:
        async with client:
            return await client.weight_norm(), await client.fwd_no_grad(batch)

    norms, scored = asyncio.run(run())
    assert norms == ray_client.weight_norm()
    assert_same(scored, ray_client.fwd_no_grad(batch))


def test_the_async_client_over_ray_gives_the_same_answers_and_refusals(ray_client: SyncArcticRLClient) -> None:
    batch = make_batch(ray_client)
    bad = dict(batch, advantages=batch["advantages"].clone())
    bad["advantages"][0, 0] = float("nan")
    client = attach_arctic_rl_client(service_name="http_tests")
    assert isinstance(client, ArcticRLClient)

    async def run() -> tuple[Any, Any, BatchValidationError]:
        async with client:
            norms, scored = await client.weight_norm(), await client.fwd_no_grad(batch)
            with pytest.raises(BatchValidationError) as refused:
                await client.fwd_bwd(bad)
            return norms, scored, refused.value

    norms, scored, refused = asyncio.run(run())
    assert norms == ray_client.weight_norm()
    assert_same(scored, ray_client.fwd_no_grad(batch))
    with pytest.raises(BatchValidationError) as blocking:
        ray_client.fwd_bwd(bad)
    assert (refused.key, str(refused)) == (blocking.value.key, str(blocking.value))
    # An attached client's shutdown leaves the service up.
    assert ray_client.weight_norm() == norms


def test_refusals_are_the_same_exceptions_and_change_nothing(
    ray_client: SyncArcticRLClient, http_client: SyncArcticRLClient
) -> None:
    batch = make_batch(http_client)
    before, step = http_client.weight_norm(), http_client.describe()["step"]
    bad = dict(batch, advantages=batch["advantages"].clone())
    bad["advantages"][0, 0] = float("nan")
    with pytest.raises(BatchValidationError) as over_http:
        http_client.fwd_bwd(bad)
    with pytest.raises(BatchValidationError) as over_ray:
        ray_client.fwd_bwd(bad)
    assert (over_http.value.key, str(over_http.value)) == (over_ray.value.key, str(over_ray.value))
    with pytest.raises(ConfigError, match="no loss named"):
        http_client.fwd_bwd(batch, {"loss_fn": "no-such-loss"})
    http_client.sleep_training()
    try:
        with pytest.raises(EngineStateError, match="wake_training") as asleep:
            http_client.fwd_bwd(batch)
        assert asleep.value.engine == "training"
    finally:
        http_client.wake_training()
    with pytest.raises(ConfigError, match="level"):
        http_client.sleep_inference(3)
    assert http_client.weight_norm() == before and http_client.describe()["step"] == step


def valid_arguments(op: str, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {
        "generate": {"prompts": PROMPTS, "sampling_params": {"n": 1}},
        "fwd_no_grad": {"batch": batch},
        "fwd_bwd": {"batch": batch},
        "train_step": {"batch": batch},
        "log_probs": {"prompts": ["a"], "completions": ["b"]},
    }.get(op, {})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
BATCH_MUTATIONS = ["drop", "dtype", "shape", "nan", "mask", "unknown_key", "not_a_tensor", "out_of_vocab"]


def mutate(batch: dict[str, torch.Tensor], mutation: str, key: str) -> dict[str, Any]:
    bad: dict[str, Any] = {name: value.clone() for name, value in batch.items()}
    if mutation == "drop":
        bad.pop(key)
    elif mutation == "dtype":
        # Float fields as integers, token ids and masks as floats with a fractional part: both refused.
        bad[key] = bad[key].long() if bad[key].dtype.is_floating_point else bad[key].float() + 0.5
    elif mutation == "shape":
        bad[key] = bad[key][:, :-1]
    elif mutation == "nan":
        bad[key] = bad[key].double()
        bad[key][0, 0] = float("nan")
    elif mutation == "mask":
        bad["attention_mask"][0, 0] = 7
    elif mutation == "unknown_key":
        bad["advantage"] = bad[key]
    elif mutation == "not_a_tensor":
        bad[key] = "tensor"
    elif mutation == "out_of_vocab":
        bad["responses"][0, 0] = 10_000
    return bad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_malformed_requests_to_every_endpoint_get_a_4xx_and_change_nothing(
    data: st.DataObject, ray_client: SyncArcticRLClient, server: ServerThread
) -> None:
    op = data.draw(st.sampled_from(sorted(OPERATIONS)))
    operation = OPERATIONS[op]
    url = f"http://127.0.0.1:{server.port}/v1/{op}"
    before, step = ray_client.weight_norm(), ray_client.describe()["step"]
    kind = data.draw(st.sampled_from(["json", "bytes", "wire", "batch"]))
    headers = {"Content-Type": "application/json"}
    if kind == "json" or operation.method == "GET":
        payload = data.draw(json_values)
        body = json.dumps(payload).encode()
        # Only bodies the operation refuses: a valid one would run it (a valid step() changes the step counter).
        try:
            parse_arguments(op, "application/json", body, MAX_REQUEST_BYTES)
            valid = True
        except ArcticRLError:
            valid = False
        assume(not valid)
    elif kind == "bytes":
        body = data.draw(st.binary(min_size=1, max_size=64))
        headers = {"Content-Type": data.draw(st.sampled_from(["application/json", CONTENT_TYPE]))}
        # Whitespace is an empty JSON body, valid for an operation without arguments (it would run, e.g. a step).
        try:
            parse_arguments(op, headers["Content-Type"], body, MAX_REQUEST_BYTES)
            valid = True
        except ArcticRLError:
            valid = False
        assume(not valid)
    elif kind == "wire":
        arguments = dict(valid_arguments(op, make_batch(ray_client)))
        arguments[data.draw(st.sampled_from(["bogus", "batch", "prompts", "level", "path"]))] = data.draw(json_values)
        body = encode_message(arguments)
        headers = {"Content-Type": CONTENT_TYPE}
        try:
            parse_arguments(op, CONTENT_TYPE, body, MAX_REQUEST_BYTES)
            valid = True
        except ArcticRLError:
            valid = False
        assume(not valid)
    else:
        assume(op in ("fwd_no_grad", "fwd_bwd", "train_step"))
        batch = make_batch(ray_client)
        mutation = data.draw(st.sampled_from(BATCH_MUTATIONS))
        key = data.draw(st.sampled_from(sorted(batch)))
        mutated = mutate(batch, mutation, key)
        if op == "train_step":
            # A mutation that leaves a valid batch (an optional key dropped) would run the step: send only refused ones.
            try:
                validate_batch(mutated, vocab_size=VOCAB, require=("old_log_probs", "advantages"))
                valid = True
            except ArcticRLError:
                valid = False
            assume(not valid)
        body = encode_message({"batch": mutated})
        headers = {"Content-Type": CONTENT_TYPE}
    response = httpx.request(operation.method, url, content=body, headers=headers, timeout=60)
    assert response.status_code < 500, (op, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()
        assert error["error"] and len(error["message"]) > 20, error
    after = ray_client.weight_norm()
    assert after["training_norm"] == before["training_norm"]
    assert ray_client.describe()["step"] == step


def test_oversize_requests_get_413_and_the_client_names_the_limit(
    server: ServerThread, http_client: SyncArcticRLClient
) -> None:
    big = {"batch": {"input_ids": torch.zeros(2, MAX_REQUEST_BYTES // 8)}}
    response = httpx.post(
        f"http://127.0.0.1:{server.port}/v1/fwd_no_grad",
        content=encode_message(big),
        headers={"Content-Type": CONTENT_TYPE},
    )
    assert response.status_code == 413 and "--max-request-mb" in response.json()["message"]
    with pytest.raises(WireFormatError, match="max-request-mb"):
        http_client.fwd_no_grad(big["batch"])


def test_a_non_loopback_server_needs_a_token_and_checks_it(ray_client: SyncArcticRLClient, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--token-file"):
        ServerSettings(host="0.0.0.0")
    token = "s3cret-" * 6
    with pytest.raises(ConfigError, match="at least"):
        ServerSettings(host="0.0.0.0", token="s3cret")
    guarded = ServerThread(create_app(ray_client, ServerSettings(host="0.0.0.0", token=token)))
    try:
        url = f"http://127.0.0.1:{guarded.port}"
        for path in ("/health", "/v1/weight_norm", "/docs", "/openapi.json"):
            assert httpx.get(url + path).status_code == 401
            assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(url + "/v1/step", content=b"{}").status_code == 401
        doubled = [("Authorization", f"Bearer {token}"), ("Authorization", f"Bearer {token}")]
        assert httpx.get(url + "/health", headers=doubled).status_code == 400
        assert httpx.get(url + "/health", headers={"Authorization": f"bearer {token}"}).status_code == 200
        assert httpx.get(url + "/health", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        with pytest.raises(ConfigError, match="401"):
            create_arctic_rl_client(http_config(guarded.port), blocking_calls=True)
        token_file = tmp_path / "token"
        token_file.write_text(token + "\n")
        with create_arctic_rl_client(http_config(guarded.port, token_file=str(token_file)), blocking_calls=True) as c:
            assert c.weight_norm() == ray_client.weight_norm()
    finally:
        guarded.stop()


def test_a_failed_call_whose_message_says_died_marks_nothing_dead(
    ray_client: SyncArcticRLClient, http_client: SyncArcticRLClient, server: ServerThread, tmp_path: Path
) -> None:
    before, step = ray_client.weight_norm(), ray_client.describe()["step"]
    with pytest.raises(ArcticRLError) as failed:
        http_client.load_checkpoint(str(tmp_path / "who-died-here"))
    assert not isinstance(failed.value, EngineDiedError)
    health = httpx.get(f"http://127.0.0.1:{server.port}/health")
    assert health.status_code == 200 and health.json()["engine_errors"] == {}
    assert ray_client.weight_norm() == before and ray_client.describe()["step"] == step


def test_slots_are_bounded_per_client_and_in_total_then_freed(ray_client: SyncArcticRLClient) -> None:
    running = ServerThread(
        create_app(ray_client, ServerSettings(max_request_bytes=MAX_REQUEST_BYTES, slot_lifetime_s=2))
    )
    url = f"http://127.0.0.1:{running.port}/v1/wire_slots"
    # Other loopback source addresses are other clients to the server.
    addresses = [f"127.0.0.{index}" for index in range(1, 6)]
    peers = {address: httpx.Client(transport=httpx.HTTPTransport(local_address=address)) for address in addresses}
    try:
        for address in ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"):
            assert {peers[address].post(url, json={"size": 16}).status_code for _ in range(16)} == {201}
        refused = peers["127.0.0.1"].post(url, json={"size": 16})
        assert refused.status_code == 429 and "this client has 16" in refused.json()["message"]
        assert 1 <= int(refused.headers["Retry-After"]) <= 2
        refused = peers["127.0.0.5"].post(url, json={"size": 16})
        assert refused.status_code == 429 and "64 slots are open" in refused.json()["message"]
        assert slot_counts(running.port)["open"] == 64
        # The server still answers, and a client that is refused a slot sends the body.
        batch = make_batch(ray_client)
        client = shared_memory_client(running.port)
        try:
            assert_same(client.fwd_no_grad(batch), ray_client.fwd_no_grad(batch))
        finally:
            client.shutdown()
        deadline = time.monotonic() + 10
        while slot_counts(running.port)["open"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert slot_counts(running.port)["open"] == 0
        assert peers["127.0.0.5"].post(url, json={"size": 16}).status_code == 201
    finally:
        for peer in peers.values():
            peer.close()
        running.stop()


def test_health_status_and_docs(server: ServerThread) -> None:
    url = f"http://127.0.0.1:{server.port}"
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    status = httpx.get(f"{url}/v1/status").json()
    assert status["running"] == [] and status["completed"] >= 0
    schema = httpx.get(f"{url}/openapi.json").json()
    assert {f"/v1/{op}" for op in OPERATIONS} <= set(schema["paths"])
    assert httpx.get(f"{url}/docs").status_code == 200


def test_nothing_answers_is_a_clear_error() -> None:
    with pytest.raises(TransportError, match="no arctic-rl server answers"):
        create_arctic_rl_client(http_config(free_port()), blocking_calls=True)


def launched(port: int, **http: Any) -> SyncArcticRLClient:
    address = ray.get_runtime_context().gcs_address
    config = http_config(port, launch_local_server=True, ray_address=address)
    if http:
        config = config.model_copy(update={"http": config.http.model_copy(update=http)})
    client = create_arctic_rl_client(config, blocking_calls=True, engine_classes=FAKES, placement_overrides=CPU_SLOTS)
    assert isinstance(client, SyncArcticRLClient)
    return client


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_launched_server_stops_with_its_engines_at_shutdown(
    ray_client: SyncArcticRLClient, capfd: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    client = launched(port)
    server = client._transport.server  # type: ignore[attr-defined]
    # Progress lines wherever a user waits: the client while the server starts, the server once it answers.
    waited = capfd.readouterr().err
    assert f"arctic-rl: waiting for the arctic-rl server launched on http://127.0.0.1:{port}" in waited
    assert f"arctic-rl: the arctic-rl server on http://127.0.0.1:{port} is ready (" in waited
    log = server.log_path.read_text()
    assert "arctic-rl: starting the engines (training x1 CPU worker, sampling x1 CPU worker)" in log
    assert "arctic-rl: engines ready (" in log
    assert f"arctic-rl-serve: listening on http://127.0.0.1:{port}, ready" in log
    engines = [engine["pid"] for engine in client.describe()["engines"].values()]
    assert client.weight_norm()["training_norm"] > 0
    client.shutdown()
    assert server.process.poll() is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_alive(pid) for pid in engines):
        time.sleep(0.5)
    assert [pid for pid in engines if process_alive(pid)] == []
    # The module's own service is untouched.
    assert ray_client.weight_norm()["training_norm"] > 0


def test_a_killed_server_gives_a_clear_error(ray_client: SyncArcticRLClient) -> None:
    client = launched(free_port())
    server = client._transport.server  # type: ignore[attr-defined]
    batch = make_batch(ray_client)
    try:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)
        with pytest.raises(TransportError, match=r"could not be reached.*tried 3 times"):
            client.weight_norm()
        with pytest.raises(TransportError, match="not retried"):
            client.fwd_bwd(batch)
    finally:
        client.shutdown()


def test_a_killed_engine_is_named_by_503_and_health_and_shutdown_leaves_nothing(ray_client: SyncArcticRLClient) -> None:
    client = launched(free_port())
    server = client._transport.server  # type: ignore[attr-defined]
    url = client._transport.url  # type: ignore[attr-defined]
    engines = client.describe()["engines"]
    pids = [engine["pid"] for engine in engines.values()]
    try:
        os.kill(engines["training[0]"]["pid"], signal.SIGKILL)
        with pytest.raises(EngineError, match=r"training\[0\].*died") as raised:
            client.weight_norm()
        assert raised.value.engine == "training[0]"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "training[0]" in health.json()["engine_errors"]
    finally:
        client.shutdown()
    assert server.process.poll() is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        time.sleep(0.5)
    assert [pid for pid in pids if process_alive(pid)] == []


def slot_counts(port: int) -> dict[str, int]:
    return dict(httpx.get(f"http://127.0.0.1:{port}/v1/status").json()["wire_slots"])


def shared_memory_client(port: int, *, blocking: bool = True, **http: Any) -> Any:
    config = http_config(port)
    config = config.model_copy(update={"http": config.http.model_copy(update={"shared_memory_min_bytes": 0, **http})})
    return create_arctic_rl_client(config, blocking_calls=blocking)


def test_batches_through_shared_memory_equal_the_body_bitwise(
    ray_client: SyncArcticRLClient, server: ServerThread
) -> None:
    batch = make_batch(ray_client)
    expected = ray_client.fwd_no_grad(batch, False, True)
    before = slot_counts(server.port)
    fast = shared_memory_client(server.port)
    body = shared_memory_client(server.port, shared_memory=False)
    try:
        assert_same(fast.fwd_no_grad(batch, calculate_entropy=True), expected)
        assert slot_counts(server.port) == {"open": 0, "created": before["created"] + 1, "used": before["used"] + 1}
        assert_same(body.fwd_no_grad(batch, calculate_entropy=True), expected)
        assert slot_counts(server.port)["created"] == before["created"] + 1
        # Refusals through a slot are the body's refusals, and change nothing.
        norm, step = ray_client.weight_norm(), ray_client.describe()["step"]
        bad = dict(batch, advantages=batch["advantages"].clone())
        bad["advantages"][0, 0] = float("nan")
        with pytest.raises(BatchValidationError) as through_slot:
            fast.fwd_bwd(bad)
        with pytest.raises(BatchValidationError) as through_body:
            body.fwd_bwd(bad)
        assert str(through_slot.value) == str(through_body.value)
        assert ray_client.weight_norm() == norm and ray_client.describe()["step"] == step
    finally:
        fast.shutdown()
        body.shutdown()

    async def run_async() -> Any:
        client = shared_memory_client(server.port, blocking=False)
        async with client:
            return await client.fwd_no_grad(batch, calculate_entropy=True)

    assert_same(asyncio.run(run_async()), expected)
    assert slot_counts(server.port) == {"open": 0, "created": before["created"] + 3, "used": before["used"] + 3}


def test_a_server_without_shared_memory_gets_the_body(ray_client: SyncArcticRLClient) -> None:
    plain = ServerThread(
        create_app(ray_client, ServerSettings(max_request_bytes=MAX_REQUEST_BYTES, shared_memory=False))
    )
    batch = make_batch(ray_client)
    client = shared_memory_client(plain.port)
    try:
        assert_same(client.fwd_no_grad(batch), ray_client.fwd_no_grad(batch))
        assert client._transport.use_slots is False  # type: ignore[attr-defined]
        assert httpx.get(f"http://127.0.0.1:{plain.port}/v1/status").json()["wire_slots"] is None
        url = f"http://127.0.0.1:{plain.port}/v1"
        refused = httpx.post(f"{url}/wire_slots", json={"size": 64})
        assert refused.status_code == 501 and "--no-shared-memory" in refused.json()["message"]
        reference = json.dumps({"slot": "arctic-rl-slot-" + "0" * 32, "nonce": "00", "size": 64})
        named = httpx.post(f"{url}/fwd_no_grad", content=reference, headers={"Content-Type": SLOT_CONTENT_TYPE})
        assert named.status_code == 400 and "--no-shared-memory" in named.json()["message"]
    finally:
        client.shutdown()
        plain.stop()


def upload(port: int, message: Any) -> bytes:
    plan = plan_message(message)
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/wire_slots", json={"size": plan.size})
    assert answer.status_code == 201, answer.text
    return write_to_slot(answer.json(), plan).encode()


SLOT_NAMES = [
    "../../etc/passwd",
    "/etc/passwd",
    "/dev/shm/arctic-rl-slot-" + "0" * 32,
    "arctic-rl-slot-" + "0" * 32,
    "",
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_bad_slots_get_a_4xx_and_change_nothing(
    data: st.DataObject, ray_client: SyncArcticRLClient, server: ServerThread
) -> None:
    url = f"http://127.0.0.1:{server.port}/v1"
    before, step = ray_client.weight_norm(), ray_client.describe()["step"]
    op = data.draw(st.sampled_from(["fwd_no_grad", "fwd_bwd"]))
    kind = data.draw(st.sampled_from(["size", "name", "reference", "mutated"]))
    responses = []
    if kind == "size":
        # Only sizes the server refuses: a valid one would open a slot that lingers until it expires.
        size = data.draw(
            st.integers(-10, 15)
            | st.integers(MAX_REQUEST_BYTES + 1, 4 * MAX_REQUEST_BYTES)
            | st.floats()
            | st.text(max_size=4)
            | st.none()
            | st.booleans()
        )
        body = data.draw(st.sampled_from([json.dumps({"size": size}), json.dumps([size]), "{", "x" * 5000]))
        responses.append(httpx.post(f"{url}/wire_slots", content=body, headers={"Content-Type": "application/json"}))
    elif kind == "name":
        reference = {
            "slot": data.draw(st.sampled_from(SLOT_NAMES) | st.text(max_size=40)),
            "nonce": data.draw(st.text(max_size=40)),
            "size": data.draw(st.integers(-5, 2 * MAX_REQUEST_BYTES)),
        }
        responses.append(
            httpx.post(f"{url}/{op}", content=json.dumps(reference), headers={"Content-Type": SLOT_CONTENT_TYPE})
        )
    else:
        batch = make_batch(ray_client)
        message = {
            "batch": mutate(
                batch, data.draw(st.sampled_from(BATCH_MUTATIONS)), data.draw(st.sampled_from(sorted(batch)))
            )
        }
        reference = json.loads(upload(server.port, message if kind == "mutated" else {"batch": batch}))
        if kind == "reference":
            field = data.draw(st.sampled_from(["nonce", "size", "slot"]))
            reference[field] = {
                "nonce": "ab" * 16,
                "size": reference["size"] + 1,
                "slot": reference["slot"][:-1] + "x",
            }[field]
        headers = {"Content-Type": SLOT_CONTENT_TYPE}
        first = httpx.post(f"{url}/{op}", content=json.dumps(reference), headers=headers)
        if kind == "mutated":
            # Some mutations still make a valid batch for the operation (fwd_no_grad needs no advantages): no 5xx.
            assert first.status_code < 500, (kind, first.status_code, first.text)
            # Used once, answered or refused: the same slot again is unknown.
            first = httpx.post(f"{url}/{op}", content=json.dumps(reference), headers=headers)
        responses.append(first)
    for response in responses:
        assert 400 <= response.status_code < 500, (kind, response.status_code, response.text)
        error = response.json()
        assert error["error"] and len(error["message"]) > 20, error
    assert ray_client.weight_norm()["training_norm"] == before["training_norm"]
    assert ray_client.describe()["step"] == step


def test_unused_slots_expire_and_close_at_shutdown(ray_client: SyncArcticRLClient) -> None:
    # Slots of the module's server may expire meanwhile: only this server's must be gone (a subset, not equality).
    files, descriptors = shm_files(), memfd_slots()
    settings_ = ServerSettings(max_request_bytes=MAX_REQUEST_BYTES, slot_lifetime_s=0.4)
    running = ServerThread(create_app(ray_client, settings_))
    try:
        batch = make_batch(ray_client)
        reference = upload(running.port, {"batch": batch})
        assert slot_counts(running.port)["open"] == 1 and len(memfd_slots() - descriptors) == 1
        deadline = time.monotonic() + 10
        while slot_counts(running.port)["open"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert memfd_slots() <= descriptors
        late = httpx.post(
            f"http://127.0.0.1:{running.port}/v1/fwd_no_grad",
            content=reference,
            headers={"Content-Type": SLOT_CONTENT_TYPE},
        )
        assert late.status_code == 400 and "expired" in late.json()["message"]
        upload(running.port, {"batch": batch})
        assert len(memfd_slots() - descriptors) == 1
    finally:
        running.stop()
    assert memfd_slots() <= descriptors and shm_files() == files


def test_a_launched_server_takes_batches_through_shared_memory(ray_client: SyncArcticRLClient) -> None:
    files = shm_files()
    port = free_port()
    client = launched(port, shared_memory_min_bytes=0)
    server_process = client._transport.server.process  # type: ignore[attr-defined]
    batch = make_batch(ray_client)
    body = shared_memory_client(port, shared_memory=False)
    try:
        # Its own engines (fresh weights, unlike the module's trained ones): the body path on the same server is the
        # reference.
        assert_same(client.fwd_no_grad(batch), body.fwd_no_grad(batch))
        assert slot_counts(port) == {"open": 0, "created": 1, "used": 1}
    finally:
        body.shutdown()
        client.shutdown()
    assert server_process.poll() is not None and shm_files() == files
