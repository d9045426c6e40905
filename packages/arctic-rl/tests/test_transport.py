"""The transport base (arctic_rl.transport): a call is written once, as an exchange, and the blocking and async faces
drive it alike: the same effects in the same order, failures raised inside the exchange (a retry catches them, a
finally clause runs), the same answer or error; the async face waits and works without holding its event loop.

The HTTP transport on both faces, in process and without engines: against a server whose service is a stand-in
(JSON, wire-format and slot requests; answers and refusals), against an address where nothing listens (retries only
for idempotent operations), and closing a launched server (stopped once, connections closed)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from http_helpers import ServerThread, free_port

from arctic_rl.client import ArcticRLClient, SyncArcticRLClient
from arctic_rl.config import ArcticRLClientConfig
from arctic_rl.errors import BatchValidationError, ConfigError, TransportError
from arctic_rl.http_client import HttpTransport
from arctic_rl.transport import Blocking, Exchange, Sleep, TransportBase

FACES = ["blocking", "async"]


def run_on_face(transport: Any, face: str, calls: list[tuple[str, dict[str, Any]]], *, close: bool = True) -> list[Any]:
    """Each call's answer, or the exception it raised; then close. One face, and one event loop for the async one."""
    if face == "blocking":
        outcomes: list[Any] = []
        for op, arguments in calls:
            try:
                outcomes.append(transport.call_sync(op, arguments))
            except Exception as error:
                outcomes.append(error)
        if close:
            transport.close_sync()
        return outcomes

    async def run() -> list[Any]:
        outcomes: list[Any] = []
        for op, arguments in calls:
            try:
                outcomes.append(await transport.call(op, arguments))
            except Exception as error:
                outcomes.append(error)
        if close:
            await transport.close()
        return outcomes

    return asyncio.run(run())


@dataclass(frozen=True)
class Ask:
    question: str


class ScriptedTransport(TransportBase[Ask]):
    """Answers each ``Ask`` from ``answers``; an exception there is raised by the face, as failed I/O would be."""

    def __init__(self, answers: dict[str, Any], backoff_s: float = 0.001) -> None:
        self.answers = answers
        self.backoff_s = backoff_s
        self.asked: list[str] = []
        self.work_threads: list[int] = []
        self.finally_ran = 0
        self.backoff_window: list[float] = []

    def exchange(self, op: str, arguments: dict[str, Any]) -> Exchange[Ask]:
        try:
            first = yield Ask(op)
        except LookupError:
            self.backoff_window.append(time.monotonic())
            yield Sleep(self.backoff_s)
            self.backoff_window.append(time.monotonic())
            first = yield Ask(f"{op} again")
        doubled = yield Blocking(lambda: self._work(first))
        return {"first": first, "doubled": doubled, **arguments}

    def closing(self) -> Exchange[Ask]:
        try:
            yield Ask("stop")
        finally:
            self.finally_ran += 1

    def _work(self, value: int) -> int:
        self.work_threads.append(threading.get_ident())
        return 2 * value

    def perform(self, effect: Ask) -> Any:
        self.asked.append(effect.question)
        answer = self.answers[effect.question]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def perform_async(self, effect: Ask) -> Any:
        await asyncio.sleep(0)
        return self.perform(effect)


@pytest.mark.parametrize("face", FACES)
def test_both_faces_drive_one_exchange_alike(face: str) -> None:
    answers = {"plain": 3, "flaky": KeyError("down"), "flaky again": 5, "broken": ValueError("bad"), "stop": None}
    transport = ScriptedTransport(answers)
    plain, flaky, broken = run_on_face(transport, face, [("plain", {"x": 1}), ("flaky", {}), ("broken", {})])
    assert plain == {"first": 3, "doubled": 6, "x": 1}
    # The face's failure is raised at the exchange's yield, which retries.
    assert flaky == {"first": 5, "doubled": 10}
    assert isinstance(broken, ValueError) and str(broken) == "bad"
    assert transport.asked == ["plain", "flaky", "flaky again", "broken", "stop"]
    assert transport.finally_ran == 1
    # Slow local work: in place on the blocking face, in a worker thread on the async face.
    on_caller_thread = [thread == threading.get_ident() for thread in transport.work_threads]
    assert on_caller_thread == [face == "blocking"] * 2


@pytest.mark.parametrize("face", FACES)
def test_a_failure_while_closing_runs_the_exchange_finally_clause_and_is_raised(face: str) -> None:
    transport = ScriptedTransport({"stop": RuntimeError("stuck")})
    with pytest.raises(RuntimeError, match="stuck"):
        run_on_face(transport, face, [])
    assert transport.finally_ran == 1


def test_the_async_face_does_not_hold_the_event_loop_during_a_backoff() -> None:
    transport = ScriptedTransport({"slow": KeyError("retry later"), "slow again": 2}, backoff_s=0.5)

    async def run() -> list[float]:
        ticks: list[float] = []
        call = asyncio.create_task(transport.call("slow", {}))
        while not call.done():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)
        await call
        return ticks

    ticks = asyncio.run(run())
    start, end = transport.backoff_window
    # A blocking wait would let nothing else run between its start and its end.
    assert sum(start < tick < end for tick in ticks) >= 5


@pytest.mark.parametrize("client_class", [ArcticRLClient, SyncArcticRLClient])
def test_a_client_closes_its_transport_once(client_class: type) -> None:
    transport = ScriptedTransport({"stop": None})
    client = client_class(transport)
    for _ in range(2):
        shutdown = client.shutdown()
        if client_class is ArcticRLClient:
            asyncio.run(shutdown)
    assert transport.asked == ["stop"] and transport.finally_ran == 1


class StandInService:
    """The server's side, without engines: answers every operation, refuses ``fwd_bwd`` as the service would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def call_sync(self, op: str, arguments: dict[str, Any]) -> Any:
        self.calls.append((op, arguments))
        if op == "fwd_bwd":
            raise BatchValidationError("advantages", "holds NaN at [0, 0]; drop or fix that sample")
        if op == "fwd_no_grad":
            return {"log_probs": arguments["batch"]["input_ids"].double() / 2}
        return {"answered": op}

    def close_sync(self) -> None:
        pass


@pytest.fixture(scope="module")
def stand_in_server() -> Iterator[tuple[ServerThread, StandInService]]:
    pytest.importorskip("fastapi")
    from arctic_rl.serve import ServerSettings, create_app

    service = StandInService()
    running = ServerThread(create_app(SyncArcticRLClient(service), ServerSettings()))
    try:
        yield running, service
    finally:
        running.stop()
        # The recorded batches decoded from slots are views of the slots' mappings, and each mapping holds a duplicate
        # of its slot's descriptor (Python's mmap keeps one): drop them, or later tests see this process's slots open.
        service.calls.clear()
        gc.collect()


def http_config(port: int, **http: Any) -> ArcticRLClientConfig:
    settings = {"retries": 2, "backoff_s": 0.01, "connect_timeout_s": 2.0, "request_timeout_s": 30.0, **http}
    return ArcticRLClientConfig(model_name="unused", comm_protocol="http", port=port, http=settings)


class RecordingHttpTransport(HttpTransport):
    """The HTTP transport, recording the I/O its faces perform."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.performed: list[Any] = []

    def perform(self, effect: Any) -> Any:
        self.performed.append(effect)
        return super().perform(effect)

    async def perform_async(self, effect: Any) -> Any:
        self.performed.append(effect)
        return await super().perform_async(effect)

    def sent(self) -> list[str]:
        """The method and last path segment of every request sent."""
        requests = [effect for effect in self.performed if hasattr(effect, "url")]
        return [f"{request.method} {request.url.rsplit('/', 1)[1]}" for request in requests]


@pytest.mark.parametrize("through_slot", [False, True])
def test_both_faces_send_the_same_requests_and_decode_the_same_answers(
    stand_in_server: tuple[ServerThread, StandInService], through_slot: bool
) -> None:
    server, service = stand_in_server
    batch = {"input_ids": torch.arange(6).reshape(2, 3)}
    calls = [
        ("weight_norm", {}),
        ("generate", {"prompts": [[1, 2]], "sampling_params": {"n": 1}}),
        ("fwd_no_grad", {"batch": batch}),
        ("fwd_bwd", {"batch": batch}),
        ("dead_engines", {}),
    ]
    slot = ["POST wire_slots"] if through_slot else []
    for face in FACES:
        config = http_config(server.port, shared_memory_min_bytes=0 if through_slot else 2**30)
        transport = RecordingHttpTransport(config)
        before = len(service.calls)
        norm, generated, scored, refused, unknown = run_on_face(transport, face, calls)
        assert norm == {"answered": "weight_norm"} and generated == {"answered": "generate"}
        assert torch.equal(scored["log_probs"], batch["input_ids"].double() / 2)
        assert isinstance(refused, BatchValidationError) and refused.key == "advantages", refused
        assert "holds NaN" in str(refused)
        assert isinstance(unknown, ConfigError) and "not an operation" in str(unknown)
        expected = ["GET weight_norm", "POST generate", *slot, "POST fwd_no_grad", *slot, "POST fwd_bwd"]
        assert transport.sent() == expected
        assert [op for op, _ in service.calls[before:]] == ["weight_norm", "generate", "fwd_no_grad", "fwd_bwd"]
        assert torch.equal(service.calls[-2][1]["batch"]["input_ids"], batch["input_ids"])
        connections = transport._sync_client if face == "blocking" else transport._async_client
        assert connections is not None and connections.is_closed


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("shared_memory", [False, True])
def test_both_faces_retry_only_idempotent_calls_when_nothing_answers(face: str, shared_memory: bool) -> None:
    transport = RecordingHttpTransport(http_config(free_port(), shared_memory=shared_memory, shared_memory_min_bytes=0))
    calls = [
        ("weight_norm", {}),
        ("fwd_no_grad", {"batch": {"input_ids": torch.ones(1, 2, dtype=torch.long)}}),
        ("step", {}),
    ]
    norm, scored, step = run_on_face(transport, face, calls)
    assert isinstance(norm, TransportError) and "could not be reached" in str(norm) and "tried 3 times" in str(norm)
    assert isinstance(scored, TransportError) and "tried 3 times" in str(scored)
    assert isinstance(step, TransportError) and "not retried" in str(step)
    # A batch bound for a slot asks for a new one on every attempt.
    batch_request = "POST wire_slots" if shared_memory else "POST fwd_no_grad"
    assert transport.sent() == ["GET weight_norm"] * 3 + [batch_request] * 3 + ["POST step"]


class LaunchedServer:
    """Stands in for the server subprocess a client launched."""

    def __init__(self) -> None:
        self.stops = 0

    def stop(self) -> None:
        self.stops += 1


@pytest.mark.parametrize("face", FACES)
def test_closing_stops_a_launched_server_once_even_when_it_no_longer_answers(face: str) -> None:
    server = LaunchedServer()
    transport = RecordingHttpTransport(http_config(free_port()), server=server)
    run_on_face(transport, face, [])
    assert server.stops == 1
    assert transport.sent() == ["POST shutdown"]
