"""Where a replayed ``forest_decode`` layer call's host time goes (the plan-once goal: <= 25 us per call).

``fca_decode.py`` reports one number, ``summary.host_issue_us_per_call``; this probe splits it on the same batch
(RL-8x16, the library's default config, the step's plan) and with the same method (each call timed on an idle
device, median of 3 x 360 calls): the public call, the replay alone, each recorded launch through the compiled
kernel's launcher with its arguments prebuilt, the Python pieces of a replay (layout key, device and stream
lookups, hook checks), and two references (one torch launch, an empty Triton kernel through its launcher). Last, a
cProfile of 360 calls. If the launches alone are near the goal, only fewer launches or fewer arguments move it.

Run on a GPU:  python benchmarks/lab/fca_host_issue_probe.py > fca_host_issue_probe.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fca_decode as fd
from common import host_issue_us

from arctic_dedup.forest import _replay
from arctic_dedup.forest._launch import replay_forest_decode
from arctic_dedup.forest.decode import forest_decode

CALLS = 360


def host_us(fn: Callable[[], Any], calls: int = CALLS) -> float:
    """Median host microseconds of ``fn``, each call started on an idle device (fca_decode's method)."""
    return host_issue_us([fn] * calls)["host_issue_us_per_call"]


def python_us(fn: Callable[[], Any], calls: int = 20000) -> float:
    """Mean microseconds of ``fn`` in a tight loop (pure host work, nothing waits for the device)."""
    fn()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - began) * 1e6 / calls


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        sys.exit("fca_host_issue_probe needs a CUDA GPU: it times launches.")
    import triton

    specs = fd._cases(fd.H200, False)
    case = fd.Case("rl8x16_adjacent", *specs["rl8x16_adjacent"], shape=fd.H200)
    print("fca_decode's host_issue (default config):", case.host_issue(None), flush=True)

    batch, workspace = case.batches[0], case.workspaces[0]
    plan = fd._forest_plan(batch, fd.H200, None, workspace)
    query, key_cache, value_cache = batch.query, batch.key_cache, batch.value_cache
    out = torch.empty_like(query)
    lse = torch.empty(query.shape[:2], device="cuda")
    scale = fd.H200.head_dim**-0.5
    tensors = (query, key_cache, value_cache, out, lse)
    forest_decode(query, key_cache, value_cache, plan, scale, out=out, lse=lse)
    torch.cuda.synchronize()
    ((_, launches),) = plan.launches.items()
    print("launches per call:", len(launches), "arguments each:", [len(launch.args) for launch in launches])

    knobs, driver = _replay._triton_runtime()
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    addresses = [tensor.data_ptr() for tensor in tensors]
    prebuilt = []
    for launch in launches:
        args = list(launch.args)
        for position, which in launch.slots:
            args[position] = addresses[which]
        prebuilt.append(tuple(args))

    def launch_one(index: int) -> None:
        launch = launches[index]
        launch.launcher(
            *launch.grid, stream, launch.function, launch.packed_metadata, None, None, None, *prebuilt[index]
        )

    def launch_all() -> None:
        for index in range(len(launches)):
            launch_one(index)

    def hooks_installed() -> bool:
        runtime = knobs.runtime
        return _replay._hook_installed(runtime.launch_enter_hook) or _replay._hook_installed(runtime.launch_exit_hook)

    rows: dict[str, float] = {
        "forest_decode (replayed)": host_us(
            lambda: forest_decode(query, key_cache, value_cache, plan, scale, out=out, lse=lse)
        ),
        "replay_forest_decode": host_us(
            lambda: replay_forest_decode(query, key_cache, value_cache, plan, scale, out, lse)
        ),
        "replay()": host_us(lambda: _replay.replay(plan.launches, tensors, scale)),
        "the recorded launches alone, arguments prebuilt": host_us(launch_all),
    }
    for index in range(len(launches)):
        rows[f"launch {index} alone ({len(prebuilt[index])} arguments)"] = host_us(
            lambda index=index: launch_one(index)
        )
    rows["python: call_key"] = python_us(lambda: _replay.call_key(tensors, scale, device))
    rows["python: hook checks"] = python_us(hooks_installed)
    rows["python: get_current_device"] = python_us(driver.active.get_current_device)
    rows["python: get_current_stream"] = python_us(lambda: driver.active.get_current_stream(device))
    rows["python: 5 x data_ptr"] = python_us(lambda: [tensor.data_ptr() for tensor in tensors])

    small = torch.zeros(16, device="cuda")

    @triton.jit
    def noop_kernel(pointer):  # type: ignore[no-untyped-def]
        pass

    compiled = noop_kernel[(1,)](small)
    pointer = small.data_ptr()
    rows["reference: one torch launch (small.add_(1))"] = host_us(lambda: small.add_(1))
    rows["reference: empty Triton kernel, kernel[(1,)](tensor)"] = host_us(lambda: noop_kernel[(1,)](small))
    rows["reference: empty Triton kernel, compiled launcher, 1 int argument"] = host_us(
        lambda: compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, pointer)
    )
    for name, value in rows.items():
        print(f"{value:9.2f} us  {name}", flush=True)

    profile = cProfile.Profile()
    torch.cuda.synchronize()
    profile.enable()
    for _ in range(CALLS):
        forest_decode(query, key_cache, value_cache, plan, scale, out=out, lse=lse)
    profile.disable()
    torch.cuda.synchronize()
    report = io.StringIO()
    pstats.Stats(profile, stream=report).sort_stats("tottime").print_stats(20)
    print(report.getvalue())


if __name__ == "__main__":
    main()
