"""Checkpoints on the real TrainingEngine (DeepSpeed ZeRO-2 on the CPU accelerator, a tiny Qwen3): a load reads no
code, verifies every file against the manifest written at save, refuses non-finite values, other shapes and tags
outside the directory, and a refused load leaves weights, optimizer state, step and RNG exactly as they were.

One engine for the module: every refused load is followed by a check that nothing changed, and the module ends with
a load that succeeds (so the checks are not satisfied by an engine that ignores loads).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import checkpoint_rank, full_parameters, fwd_bwd, make_batch, make_config

pytest.importorskip("deepspeed", reason="needs arctic-rl[engines]")
pytest.importorskip("transformers", reason="needs arctic-rl[engines]")

from arctic_rl.engines.checkpoint_files import MANIFEST_NAME, write_manifest
from arctic_rl.engines.deepspeed_base import free_port
from arctic_rl.engines.training import TrainingEngine
from arctic_rl.errors import InvalidRequestError
from arctic_rl.testing import save_tiny_qwen3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="these tests drive DeepSpeed's CPU accelerator"),
]

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIMIZER_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class _Planted:
    """A pickle that writes a marker file when unpickled by a loader that runs code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.marker), "code ran"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3")))


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[TrainingEngine]:
    torch.set_num_threads(1)
    trainer = TrainingEngine(make_config(model_dir, training={"zero_stage": 2}))
    fwd_bwd(trainer, make_batch(seed=1))
    trainer.step()
    yield trainer
    trainer.shutdown()


@pytest.fixture(scope="module")
def saved(engine: TrainingEngine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of step 1; the engine then trains one more step, so a load would visibly change it."""
    root = tmp_path_factory.mktemp("checkpoints")
    engine.save_checkpoint(str(root), 1)
    fwd_bwd(engine, make_batch(seed=2))
    engine.step()
    return root


def _state(engine: TrainingEngine) -> dict[str, Any]:
    optimizer = engine._engine.optimizer.state_dict()
    return {
        "weights": full_parameters(engine),
        "optimizer": _tensors(optimizer),
        "step": engine.step_count,
        "lr": engine.lr,
        "rng": torch.get_rng_state(),
    }


def _tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        found[prefix] = value.detach().clone()
    elif isinstance(value, dict):
        for key, item in value.items():
            found.update(_tensors(item, f"{prefix}.{key}"))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found.update(_tensors(item, f"{prefix}[{index}]"))
    return found


def _assert_unchanged(engine: TrainingEngine, before: dict[str, Any]) -> None:
    after = _state(engine)
    assert after["step"] == before["step"] and after["lr"] == before["lr"]
    assert torch.equal(after["rng"], before["rng"])
    for group in ("weights", "optimizer"):
        assert after[group].keys() == before[group].keys()
        for name, tensor in before[group].items():
            assert torch.equal(after[group][name], tensor), f"{group} {name} changed"


def _copy(saved: Path, target: Path) -> Path:
    shutil.copytree(saved, target)
    return target


def _refused(engine: TrainingEngine, path: Path | str, match: str, step: int | None = None) -> None:
    before = _state(engine)
    with pytest.raises(InvalidRequestError, match=match):
        engine.load_checkpoint(str(path), step)
    _assert_unchanged(engine, before)


def test_save_writes_a_manifest_of_every_file(saved: Path) -> None:
    manifest = json.loads((saved / "global_step1" / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == [MODEL_FILE, OPTIMIZER_FILE]
    assert (saved / "latest").read_text() == "global_step1"


def test_a_planted_pickle_runs_no_code(engine: TrainingEngine, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "latest").write_text(".")
    torch.save({"module": _Planted(str(marker))}, planted / MODEL_FILE)
    _refused(engine, planted, "not a checkpoint of this directory")
    # Even as a tag with a manifest that lists it, the file is read without running its code.
    tag = planted / "global_step0"
    tag.mkdir()
    shutil.move(planted / MODEL_FILE, tag / MODEL_FILE)
    write_manifest(str(tag))
    _refused(engine, planted, "weights_only=True", step=0)
    assert not marker.exists()


def test_corrupted_truncated_or_missing_files_are_refused(engine: TrainingEngine, saved: Path, tmp_path: Path) -> None:
    flipped = _copy(saved, tmp_path / "flipped")
    data = bytearray((flipped / "global_step1" / MODEL_FILE).read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(byte ^ 0xFF for byte in data[middle : middle + 4096])
    (flipped / "global_step1" / MODEL_FILE).write_bytes(bytes(data))
    _refused(engine, flipped, "does not match its manifest")

    truncated = _copy(saved, tmp_path / "truncated")
    optimizer = truncated / "global_step1" / OPTIMIZER_FILE
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    _refused(engine, truncated, "does not match its manifest")

    missing = _copy(saved, tmp_path / "missing")
    (missing / "global_step1" / OPTIMIZER_FILE).unlink()
    _refused(engine, missing, "incomplete")

    unlisted = _copy(saved, tmp_path / "unlisted")
    (unlisted / "global_step1" / MANIFEST_NAME).unlink()
    _refused(engine, unlisted, "no arctic_rl_manifest.json")


def _rewrite_model_file(saved: Path, target: Path, change: Any) -> Path:
    """A copy whose model file was changed by ``change(state)`` and re-listed in the manifest (a consistent file,
    so the check under test is the one that refuses it)."""
    copy = _copy(saved, target)
    path = copy / "global_step1" / MODEL_FILE
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    write_manifest(str(copy / "global_step1"))
    return copy


def test_non_finite_values_and_other_shapes_are_refused(engine: TrainingEngine, saved: Path, tmp_path: Path) -> None:
    name = next(iter(engine.module.state_dict()))

    def poison(state: dict[str, Any]) -> None:
        state["module"][name] = state["module"][name].clone()
        state["module"][name].view(-1)[3] = float("nan")

    _refused(engine, _rewrite_model_file(saved, tmp_path / "nan", poison), "non-finite")

    def reshape(state: dict[str, Any]) -> None:
        state["module"][name] = torch.zeros(7, 3)

    _refused(engine, _rewrite_model_file(saved, tmp_path / "shape", reshape), "has shape")


def test_tags_and_paths_outside_the_checkpoint_are_refused(engine: TrainingEngine, saved: Path, tmp_path: Path) -> None:
    escaping = tmp_path / "escaping"
    escaping.mkdir()
    _copy(saved / "global_step1", tmp_path / "other" / "global_step0")
    (escaping / "latest").write_text("../other/global_step0")
    _refused(engine, escaping, "not a checkpoint of this directory")
    linked = tmp_path / "linked"
    linked.mkdir()
    os.symlink(saved / "global_step1", linked / "global_step1")
    _refused(engine, linked, "no checkpoint 'global_step1'", step=1)
    _refused(engine, tmp_path / "does-not-exist", "does not exist")
    (tmp_path / "a-file").write_text("x")
    _refused(engine, tmp_path / "a-file", "is not a directory")
    _refused(engine, saved, "no checkpoint 'global_step7'", step=7)
    _refused(engine, saved, "must be an integer", step="1")  # type: ignore[arg-type]
    _refused(engine, saved, "must be an integer", step=True)  # type: ignore[arg-type]


def test_unusable_save_paths_are_refused(engine: TrainingEngine, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(InvalidRequestError, match="not a directory"):
        engine.save_checkpoint(str(tmp_path / "a-file"), 1)
    # Not creatable, whoever the server runs as (root ignores permission bits).
    with pytest.raises(InvalidRequestError, match="cannot create"):
        engine.save_checkpoint(str(tmp_path / "a-file" / "inner"), 1)
    with pytest.raises(InvalidRequestError, match="must be an integer"):
        engine.save_checkpoint(str(tmp_path / "fine"), "1")  # type: ignore[arg-type]


def test_a_verified_checkpoint_loads_after_the_refusals(engine: TrainingEngine, saved: Path) -> None:
    before = _state(engine)
    assert engine.load_checkpoint(str(saved)) == 1
    after = _state(engine)
    assert after["step"] == 1
    assert any(not torch.equal(after["weights"][name], before["weights"][name]) for name in before["weights"])


def test_two_ranks_refuse_together_when_one_finds_the_checkpoint_damaged(model_dir: str, tmp_path: Path) -> None:
    """Every rank verifies before DeepSpeed's collective load: when one refuses, all do (no rank enters the load
    alone and hangs), nothing changes on either, and a good checkpoint then loads on both."""
    import time

    context = torch.multiprocessing.start_processes(
        checkpoint_rank,
        args=(2, free_port(), model_dir, str(tmp_path), str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 600
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError("the two ranks did not finish within 600 s (a collective mismatch?)")
    outcomes = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    assert "another training rank refused" in outcomes[0]["refusal"]
    assert "does not match its manifest" in outcomes[1]["refusal"]
    for outcome in outcomes:
        assert outcome["unchanged"] and outcome["restored"]
        assert outcome["step"] == 1 and outcome["step_count"] == 1
