"""arctic-rl over HTTP: a bounded load test and the wire format's throughput, on loopback.

Load: one ``arctic-rl-serve`` server (launched by the first client, tiny random-init Qwen3 on the CPU, the real
engines) and ``--clients`` concurrent async clients, each sending ``--requests`` operations drawn from a fixed mix
(``weight_norm``, ``describe``, ``last_step_metrics``, ``fwd_no_grad`` of a small batch, ``generate`` of one short
sample). Every answer is checked against the one the first client got alone (same weights, same seeds), so nothing
lost or garbled passes; latencies give p50/p99 per operation and overall. ``summary.control_call_ms`` is the median
of ``last_step_metrics`` alone (a call that reaches the service and no engine). Goal: <= 5 ms.

Wire: a ``--wire-mib`` batch (float32 ``old_log_probs``-like tensors) is encoded and posted by the client's HTTP
transport, as a user gets it by default, to the server's own application (``arctic_rl.serve.create_app`` in a process
of its own: size limit, parsing, decoding with every check; the service behind it is a stand-in that answers at once)
and decoded there; GB/s of that against a plain memory copy of the same bytes on the same machine gives
``summary.wire_copy_fraction``. Goal: >= 0.25. On loopback the default transport writes the batch into a
shared-memory upload slot (``arctic_rl.wire_slots``; the script checks that the server used one per request);
``summary.wire_body_gbps`` is the same batch sent as the HTTP body (``http.shared_memory=False``, what a server on
another host gets).

Run it only on an idle machine (other load skews both parts):

    python benchmarks/rl_http.py                    # 16 clients x 50 requests, a 1 GiB batch
    python benchmarks/rl_http.py --smoke            # 2 clients x 5 requests, a 16 MiB batch: checks the script
    python benchmarks/rl_http.py --wire-only        # the wire part again, into the existing results file
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import default_out_dir, print_table, run_metadata, write_results

NAME = "rl_http"
CONTROL_GOAL_MS = 5.0
WIRE_GOAL = 0.25
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
SAMPLING = {"n": 1, "max_tokens": 2, "temperature": 1.0, "seed": 7}
MIX = ["weight_norm", "describe", "last_step_metrics", "fwd_no_grad", "generate"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def small_batch() -> dict[str, torch.Tensor]:
    from arctic_rl import build_grpo_batch

    samples = [[{"token_ids": [5, 6, 7], "logprobs": [-1.0, -1.0, -1.0]}] for _ in PROMPTS]
    batch = build_grpo_batch(PROMPTS, samples, [[0.0]] * len(PROMPTS), pad_token_id=256)
    batch.pop("prompts")
    return batch


async def call(client: Any, op: str, batch: dict[str, torch.Tensor]) -> Any:
    if op == "fwd_no_grad":
        return (await client.fwd_no_grad(batch))["logprobs"]
    if op == "generate":
        return await client.generate(PROMPTS, SAMPLING)
    return await getattr(client, op)()


def same(left: Any, right: Any) -> bool:
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and left.dtype == right.dtype and torch.equal(left, right)
    return bool(left == right)


async def load_test(port: int, clients: int, requests: int, reference: dict[str, Any]) -> dict[str, Any]:
    from arctic_rl import ArcticRLClientConfig, create_arctic_rl_client

    config = ArcticRLClientConfig(model_name="unused-by-an-attached-client", comm_protocol="http", port=port)
    batch = small_batch()
    latencies: dict[str, list[float]] = {op: [] for op in MIX}
    wrong: list[str] = []

    async def one_client(index: int) -> int:
        # Attaching checks /health once (a blocking call): done in a thread, outside the event loop.
        client = await asyncio.to_thread(create_arctic_rl_client, config)
        answered = 0
        async with client:
            for request in range(requests):
                op = MIX[(index + request) % len(MIX)]
                start = time.perf_counter()
                answer = await call(client, op, batch)
                latencies[op].append((time.perf_counter() - start) * 1e3)
                if not same(answer, reference[op]):
                    wrong.append(f"client {index} request {request} {op}")
                answered += 1
        return answered

    start = time.perf_counter()
    answered = await asyncio.gather(*(one_client(index) for index in range(clients)))
    seconds = time.perf_counter() - start
    every = [value for values in latencies.values() for value in values]
    return {
        "answered": sum(answered),
        "expected": clients * requests,
        "wrong": wrong,
        "seconds": seconds,
        "p50_ms": percentile(every, 0.5),
        "p99_ms": percentile(every, 0.99),
        "per_op": {
            op: {"count": len(values), "p50_ms": percentile(values, 0.5), "p99_ms": percentile(values, 0.99)}
            for op, values in latencies.items()
            if values
        },
    }


async def reference_answers(client: Any) -> dict[str, Any]:
    batch = small_batch()
    return {op: await call(client, op, batch) for op in MIX}


async def control_call_ms(client: Any, repeats: int) -> float:
    for _ in range(5):
        await client.last_step_metrics()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await client.last_step_metrics()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class _ImmediateService:
    """The service behind the wire measurement: answers fwd_no_grad at once, so only the HTTP path is timed."""

    def fwd_no_grad(
        self, batch: dict[str, Any], reference_model: bool, calculate_entropy: bool, *, temperature: float = 1.0
    ) -> dict[str, Any]:
        return {}


def serve_immediate(port: int, limit: int) -> None:
    """Child process: the server's own application (``create_app``) over the stand-in service, on ``port``."""
    import uvicorn

    from arctic_rl.serve import ServerSettings, create_app

    app = create_app(_ImmediateService(), ServerSettings(port=port, max_request_bytes=limit))  # type: ignore[arg-type]
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def post_batches(port: int, limit_mib: int, batch: dict[str, torch.Tensor], repeats: int, shared: bool) -> list[float]:
    """Seconds of each of ``repeats`` fwd_no_grad calls with ``batch`` through the client's HTTP transport."""
    import httpx

    from arctic_rl import ArcticRLClientConfig
    from arctic_rl.http_client import HttpTransport

    http = {"max_request_mb": limit_mib, "shared_memory": shared}
    transport = HttpTransport(ArcticRLClientConfig(model_name="unused", comm_protocol="http", port=port, http=http))
    arguments = {"batch": batch, "reference_model": False, "calculate_entropy": False}
    used = httpx.get(f"http://127.0.0.1:{port}/v1/status").json()["wire_slots"]["used"]
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        # The stand-in answers {} only after the server read, decoded and validated the message.
        assert transport.call_sync("fwd_no_grad", arguments) == {}
        seconds.append(time.perf_counter() - start)
    transport.close_sync()
    slots = httpx.get(f"http://127.0.0.1:{port}/v1/status").json()["wire_slots"]
    assert slots["used"] - used == (repeats if shared else 0), f"the server used {slots['used'] - used} slots"
    return seconds


def wire_throughput(mib: int, repeats: int) -> dict[str, float]:
    """Encode + post + decode a ``mib`` MiB batch through the client's HTTP transport and the server's application
    (in its own process), against a plain copy of the same bytes; by default (shared memory) and as the body."""
    import httpx

    rows = 1024
    columns = mib * 1024**2 // 4 // rows // 2
    generator = torch.Generator().manual_seed(0)
    batch = {
        "old_log_probs": torch.randn(rows, columns, generator=generator),
        "advantages": torch.randn(rows, columns, generator=generator),
    }
    size = sum(tensor.numel() * tensor.element_size() for tensor in batch.values())
    limit_mib = 2 * mib + 64
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--immediate-server", str(port), str(limit_mib * 1024**2)], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "the stand-in server did not start"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        wire_seconds = post_batches(port, limit_mib, batch, repeats, shared=True)
        body_seconds = post_batches(port, limit_mib, batch, repeats, shared=False)
    finally:
        server.terminate()
        server.wait(timeout=60)
    source = torch.cat([tensor.flatten() for tensor in batch.values()])
    target = torch.empty_like(source)
    copy_seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        copy_seconds.append(time.perf_counter() - start)
    wire_gbps = size / statistics.median(wire_seconds) / 1e9
    copy_gbps = size / statistics.median(copy_seconds) / 1e9
    return {
        "bytes": size,
        "wire_gbps": wire_gbps,
        "wire_body_gbps": size / statistics.median(body_seconds) / 1e9,
        "copy_gbps": copy_gbps,
        "wire_copy_fraction": wire_gbps / copy_gbps,
    }


def run_load(args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    from arctic_rl import ArcticRLClientConfig, create_arctic_rl_client
    from arctic_rl.testing import save_tiny_qwen3

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = save_tiny_qwen3(Path(scratch) / "tiny-qwen3", seed=0)
        config = ArcticRLClientConfig(
            model_name=str(model_dir),
            device="cpu",
            dtype="float32",
            comm_protocol="http",
            launch_local_server=True,
            port=free_port(),
            sampling={"max_model_len": 128, "kv_cache_space_gib": 1},
        )
        owner = create_arctic_rl_client(config, placement_overrides={"cpus_per_cpu_worker": 0.25})

        async def measure() -> tuple[dict[str, Any], float]:
            async with owner:
                reference = await reference_answers(owner)
                control = await control_call_ms(owner, args.control_repeats)
                load = await load_test(config.port, args.clients, args.requests, reference)
                return load, control

        return asyncio.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="2 clients x 5 requests and a 16 MiB batch")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=50, help="requests per client")
    parser.add_argument("--wire-mib", type=int, default=1024, help="size of the wire batch in MiB")
    parser.add_argument("--wire-repeats", type=int, default=3)
    parser.add_argument("--control-repeats", type=int, default=200)
    parser.add_argument(
        "--wire-only",
        action="store_true",
        help="measure only the wire and replace its fields in the existing results file (meta.wire says when)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--immediate-server", nargs=2, type=int, metavar=("PORT", "LIMIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.immediate_server:
        serve_immediate(*args.immediate_server)
        return
    if args.smoke:
        args.clients, args.requests, args.wire_mib, args.wire_repeats, args.control_repeats = 2, 5, 16, 2, 20
    wire = wire_throughput(args.wire_mib, args.wire_repeats)
    wire_fields = {
        "wire_bytes": wire["bytes"],
        "wire_gbps": wire["wire_gbps"],
        "wire_body_gbps": wire["wire_body_gbps"],
        "copy_gbps": wire["copy_gbps"],
        "wire_copy_fraction": wire["wire_copy_fraction"],
        "wire_copy_goal": WIRE_GOAL,
    }
    if args.wire_only:
        path = (args.out or default_out_dir()) / f"{NAME}.json"
        result = json.loads(path.read_text())
        result["summary"].update(wire_fields)
        # The load test's fields keep their own run's meta; the wire's run is recorded beside it, with the load
        # average of the machine (1, 5, 15 min) at its end.
        result["meta"]["wire"] = {**run_metadata(), "load_average": list(os.getloadavg())}
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(wire_fields))
        return
    load, control = run_load(args)
    summary = {
        "clients": args.clients,
        "requests_per_client": args.requests,
        "answered": load["answered"],
        "lost_or_wrong": load["expected"] - load["answered"] + len(load["wrong"]),
        "p50_ms": load["p50_ms"],
        "p99_ms": load["p99_ms"],
        "control_call_ms": control,
        "control_call_goal_ms": CONTROL_GOAL_MS,
        **wire_fields,
        "smoke": args.smoke,
    }
    rows = [{"operation": op, **values} for op, values in load["per_op"].items()]
    print_table(rows, ["operation", "count", "p50_ms", "p99_ms"])
    path = write_results(args.out or default_out_dir(), NAME, summary, rows)
    print(f"wrote {path}")
    if load["wrong"] or load["answered"] != load["expected"]:
        raise SystemExit(f"the load test lost or garbled answers: {load['wrong'][:10]}")


if __name__ == "__main__":
    main()
