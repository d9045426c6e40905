"""arctic-rl under hostile and mistaken input (issue #38), through the client as users call it, with the real engines
on the CPU: Ray local, DeepSpeed ZeRO-2 with ZoRRO, vLLM's CPU build in-process, a tiny random-init Qwen3.

One client for the module. Every bad request must be refused with ``InvalidRequestError`` (or the batch/config
errors) before it reaches an engine, and leave the service answering and unchanged: the same weight norms, the same
step, the same fixed-seed generate, no engine declared failed. A seeded fuzz test then sends random values to
generate, fwd_bwd and the checkpoint operations with the same checks after each, and the module ends with a step and
a load that succeed (so the checks are not met by engines that ignore everything).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")
pytest.importorskip("deepspeed")

from ray_helpers import retry_start  # noqa: E402

from arctic_rl import (  # noqa: E402
    ArcticRLClientConfig,
    BatchValidationError,
    ConfigError,
    SyncArcticRLClient,
    build_grpo_batch,
    create_arctic_rl_client,
)
from arctic_rl.engines.checkpoint_files import MANIFEST_NAME, write_manifest  # noqa: E402
from arctic_rl.errors import InvalidRequestError  # noqa: E402
from arctic_rl.service import attach_service  # noqa: E402
from arctic_rl.testing import TINY_QWEN3, save_tiny_qwen3  # noqa: E402

pytestmark = pytest.mark.slow

VOCAB = TINY_QWEN3["vocab_size"]
POSITIONS = TINY_QWEN3["max_position_embeddings"]
MAX_MODEL_LEN = 128
PAD = 256
PROMPTS = [[10, 11, 12, 13], [20, 21, 22]]
FIXED = {"n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 11}
REFUSALS = (InvalidRequestError, BatchValidationError, ConfigError)


class Planted:
    """A pickle that writes a marker file when a loader runs its code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.marker), "code ran"))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SyncArcticRLClient]:
    retry_start(lambda: ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="arctic_rl_38"))
    model_dir = save_tiny_qwen3(tmp_path_factory.mktemp("hostile") / "tiny-qwen3", seed=5)
    config = ArcticRLClientConfig(
        model_name=str(model_dir),
        device="cpu",
        dtype="float32",
        seed=0,
        training={"lr": 1e-2, "zero_stage": 2},
        zorro_train={"enable": True},
        sampling={"max_model_len": MAX_MODEL_LEN, "kv_cache_space_gib": 1, "max_sequences_per_request": 64},
    )
    started = create_arctic_rl_client(config, blocking_calls=True, placement_overrides={"cpus_per_cpu_worker": 0.25})
    assert isinstance(started, SyncArcticRLClient)
    try:
        yield started
    finally:
        started.shutdown()
        ray.shutdown()


def _batch(client: SyncArcticRLClient) -> dict[str, torch.Tensor]:
    samples = client.generate(PROMPTS, FIXED)
    rewards = [[float(index) for index in range(len(group))] for group in samples]
    batch = build_grpo_batch(PROMPTS, samples, rewards, pad_token_id=PAD)
    batch.pop("prompts")
    batch["old_log_probs"] = batch["rollout_log_probs"].clone()
    return batch


@pytest.fixture(scope="module")
def checkpoint(client: SyncArcticRLClient, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state after one real step, saved; the tests then check every refusal against this state."""
    client.fwd_bwd(_batch(client))
    client.step()
    client.sync_weights()
    root = tmp_path_factory.mktemp("saved")
    client.save_checkpoint(str(root))
    return root


def _snapshot(client: SyncArcticRLClient) -> dict[str, Any]:
    return {
        "norms": client.weight_norm(),
        "step": client.describe()["step"],
        "samples": client.generate(PROMPTS, FIXED),
    }


@pytest.fixture
def unchanged(client: SyncArcticRLClient, checkpoint: Path) -> Callable[[], None]:
    """Asserts the service answers, no engine is declared failed and nothing changed since the test started."""
    before = _snapshot(client)
    service = attach_service()

    def check() -> None:
        assert ray.get(service.dead_engines.remote()) == {}
        assert _snapshot(client) == before

    return check


def _refused(call: Callable[[], Any], field: str, error: type[Exception] = InvalidRequestError) -> None:
    with pytest.raises(error) as raised:
        call()
    if isinstance(raised.value, InvalidRequestError):
        assert raised.value.field == field, raised.value
    elif isinstance(raised.value, BatchValidationError):
        assert raised.value.key == field, raised.value


BAD_GENERATES: list[tuple[Any, Any, str]] = [
    (PROMPTS, {"max_tokens": 2, "seed": "x"}, "sampling_params.seed"),
    (PROMPTS, {"max_tokens": 2, "seed": 2**64}, "sampling_params.seed"),
    (PROMPTS, {"max_tokens": 2, "logprobs": VOCAB + 1}, "sampling_params.logprobs"),
    (PROMPTS, {"max_tokens": 2, "logit_bias": {str(VOCAB): 1.0}}, "sampling_params.logit_bias"),
    (PROMPTS, {"max_tokens": 2, "allowed_token_ids": [VOCAB + 7]}, "sampling_params.allowed_token_ids"),
    (PROMPTS, {"max_tokens": 2, "structured_outputs": {"regex": "(["}}, "sampling_params"),
    (PROMPTS, {"max_tokens": 2, "n": 33}, "sampling_params.n"),  # 2 prompts x 33 > 64 per request
    (PROMPTS, {"max_tokens": MAX_MODEL_LEN + 1}, "sampling_params.max_tokens"),
    (PROMPTS, {"max_tokens": 2, "bogus": 1}, "sampling_params.bogus"),
    ([[VOCAB]], {"max_tokens": 2}, "prompts[0]"),
    ([[-3]], {"max_tokens": 2}, "prompts[0]"),
    ([[True]], {"max_tokens": 2}, "prompts[0]"),
    ([[]], {"max_tokens": 2}, "prompts[0]"),
    ([""], {"max_tokens": 2}, "prompts[0]"),
    ([[1] * MAX_MODEL_LEN], {"max_tokens": 2}, "prompts[0]"),
    ([], {"max_tokens": 2}, "prompts"),
]


def test_bad_generate_requests_are_refused_and_change_nothing(
    client: SyncArcticRLClient, unchanged: Callable[[], None]
) -> None:
    for prompts, params, field in BAD_GENERATES:
        _refused(lambda p=prompts, s=params: client.generate(p, s), field)
    unchanged()


def test_bad_training_requests_are_refused_and_change_nothing(
    client: SyncArcticRLClient, unchanged: Callable[[], None]
) -> None:
    batch = _batch(client)
    for processing, field in (
        ({"loss_fn": ["grpo"]}, "processing.loss_fn"),
        ({"loss_fn": {"name": "grpo"}}, "processing.loss_fn"),
        ({"loss_fn": "grpo", "config": ["clip_ratio_low"]}, "processing.config"),
        ({"loss_fn": "grpo", "config": "clip"}, "processing.config"),
    ):
        _refused(lambda p=processing: client.fwd_bwd(batch, p), field)
    # Rows wider than the model's positions.
    width = POSITIONS + 8
    long = {
        "input_ids": torch.ones(2, width, dtype=torch.long),
        "attention_mask": torch.ones(2, width, dtype=torch.long),
        "responses": torch.ones(2, 4, dtype=torch.long),
        "response_mask": torch.ones(2, 4, dtype=torch.long),
        "old_log_probs": torch.zeros(2, 4),
        "advantages": torch.ones(2, 4),
    }
    _refused(lambda: client.fwd_bwd(long), "input_ids", BatchValidationError)
    _refused(lambda: client.fwd_no_grad(long), "input_ids", BatchValidationError)
    flags = dict(batch, response_mask=batch["response_mask"].bool().float() * 2)
    _refused(lambda: client.fwd_bwd(flags), "response_mask", BatchValidationError)
    unchanged()


def test_bad_checkpoint_requests_are_refused_and_change_nothing(
    client: SyncArcticRLClient, checkpoint: Path, tmp_path: Path, unchanged: Callable[[], None]
) -> None:
    # A path that says "died" is a user's mistake like any other: refused, and no engine is declared failed.
    _refused(lambda: client.load_checkpoint(str(tmp_path / "who-died-here")), "path")
    _refused(lambda: client.load_checkpoint(str(checkpoint), step=99), "step")
    _refused(lambda: client.load_checkpoint(str(checkpoint), step="1"), "step")  # type: ignore[arg-type]
    (tmp_path / "a-file").write_text("x")
    _refused(lambda: client.save_checkpoint(str(tmp_path / "a-file")), "path")
    _refused(lambda: client.save_checkpoint(str(tmp_path / "a-file" / "below")), "path")
    _refused(lambda: client.save_checkpoint(str(tmp_path / "fine"), step=True), "step")  # type: ignore[arg-type]

    # The planted checkpoint of the issue: latest = "." and a model file whose object runs code when unpickled.
    marker, planted = tmp_path / "marker", tmp_path / "planted"
    planted.mkdir()
    (planted / "latest").write_text(".")
    torch.save({"module": Planted(str(marker))}, planted / "mp_rank_00_model_states.pt")
    _refused(lambda: client.load_checkpoint(str(planted)), "path")
    shutil.copytree(planted, planted / "global_step0")
    write_manifest(str(planted / "global_step0"))
    _refused(lambda: client.load_checkpoint(str(planted), step=0), "path")
    assert not marker.exists()

    # Half a checkpoint, or a changed one, loads nothing.
    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoint, truncated)
    tag = truncated / (checkpoint / "latest").read_text()
    optimizer = next(tag.glob("*optim_states.pt"))
    optimizer.write_bytes(optimizer.read_bytes()[:4096])
    _refused(lambda: client.load_checkpoint(str(truncated)), "path")
    optimizer.unlink()
    _refused(lambda: client.load_checkpoint(str(truncated)), "path")
    escaping = tmp_path / "escaping"
    escaping.mkdir()
    (escaping / "latest").write_text(f"../{checkpoint.name}/{(checkpoint / 'latest').read_text()}")
    _refused(lambda: client.load_checkpoint(str(escaping)), "path")
    unchanged()


def _fuzz_value(rng: random.Random) -> Any:
    pool: list[Callable[[], Any]] = [
        lambda: rng.randint(-(2**70), 2**70),
        lambda: rng.choice([-1, 0, 1, 2, VOCAB - 1, VOCAB, POSITIONS, 2**31, 2**63, 2**64]),
        lambda: rng.uniform(-1e6, 1e6),
        lambda: rng.choice([float("nan"), float("inf"), -0.0, 1e-300]),
        lambda: rng.choice(["", "x", "1", "../../etc", "who-died-here", "\u00e9\u4e2d", "(["]),
        lambda: rng.choice([True, False, None]),
        lambda: [rng.randint(-5, VOCAB + 5) for _ in range(rng.randint(0, 4))],
        lambda: {str(rng.randint(-5, VOCAB + 5)): rng.uniform(-200, 200)},
        lambda: {"regex": rng.choice(["(", "[a-", "a{99999999}", "."])},
    ]
    return rng.choice(pool)()


FUZZED_SAMPLING_KEYS = [
    *("n", "max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "logit_bias", "allowed_token_ids"),
    *("stop_token_ids", "min_tokens", "structured_outputs", "stop", "unknown_key"),
]


def _fuzz_generate(client: SyncArcticRLClient, rng: random.Random) -> None:
    params: dict[str, Any] = {"max_tokens": 2}
    for key in rng.sample(FUZZED_SAMPLING_KEYS, rng.randint(1, 3)):
        params[key] = _fuzz_value(rng)
    prompts: Any = PROMPTS if rng.random() < 0.6 else rng.choice([[_fuzz_value(rng)], _fuzz_value(rng)])
    client.generate(prompts, params)


def _fuzz_fwd_bwd(client: SyncArcticRLClient, rng: random.Random, batch: dict[str, torch.Tensor]) -> None:
    """A batch with one field broken (so a call that passes would be a missed refusal, not a training step)."""
    broken = dict(batch)
    key = rng.choice(sorted(broken))
    value = broken[key].clone()
    change = rng.randrange(4)
    if change == 0:
        junk = _fuzz_value(rng)
        broken[key] = "x" if junk is None else junk
    elif change == 1:
        broken[key] = value.unsqueeze(0)
    elif change == 2:
        broken[key] = value.to(torch.complex64)
    elif value.dtype.is_floating_point:
        value.view(-1)[rng.randrange(value.numel())] = rng.choice([float("nan"), float("inf")])
        broken[key] = value
    else:
        broken[key] = value.view(-1)[rng.randrange(value.numel())].reshape(1, 1).expand(2, POSITIONS + 1)
    processing = None if rng.random() < 0.5 else {"loss_fn": "grpo", "config": {"clip_ratio_low": _fuzz_value(rng)}}
    client.fwd_bwd(broken, processing)


def _fuzz_checkpoint(client: SyncArcticRLClient, rng: random.Random, checkpoint: Path, tmp_path: Path) -> None:
    """A damaged copy of the saved checkpoint (bytes flipped, cut, removed, or a foreign tag), or a bad argument."""
    copy = tmp_path / f"fuzz{rng.randrange(10**9)}"
    shutil.copytree(checkpoint, copy)
    tag = copy / (checkpoint / "latest").read_text()
    files = sorted(path for path in tag.iterdir() if path.name != MANIFEST_NAME)
    target = rng.choice(files)
    damage = rng.randrange(5)
    if damage == 0:
        data = bytearray(target.read_bytes())
        start = rng.randrange(len(data))
        for index in range(start, min(len(data), start + rng.randint(1, 4096))):
            data[index] ^= rng.randint(1, 255)
        target.write_bytes(bytes(data))
    elif damage == 1:
        target.write_bytes(target.read_bytes()[: rng.randrange(target.stat().st_size)])
    elif damage == 2:
        target.unlink()
    elif damage == 3:
        (copy / "latest").write_text(str(_fuzz_value(rng)))
    else:
        step = _fuzz_value(rng)
        if step is None or (type(step) is int and step == client.describe()["step"]):
            step = str(step)  # not a valid step: this branch sends bad arguments only
        client.load_checkpoint(rng.choice([str(copy), _fuzz_value(rng)]), step=step)
        return
    client.load_checkpoint(str(copy))


FUZZ_ROUNDS = 24


def test_fuzzed_requests_get_only_refusals_and_change_nothing(
    client: SyncArcticRLClient, checkpoint: Path, tmp_path: Path, unchanged: Callable[[], None]
) -> None:
    rng = random.Random(38)
    batch = _batch(client)
    outcomes: dict[str, int] = {}
    for round_index in range(FUZZ_ROUNDS):
        operation = ("generate", "fwd_bwd", "checkpoint")[round_index % 3]
        try:
            if operation == "generate":
                _fuzz_generate(client, rng)
            elif operation == "fwd_bwd":
                _fuzz_fwd_bwd(client, rng, batch)
            else:
                _fuzz_checkpoint(client, rng, checkpoint, tmp_path)
            outcome = f"{operation}: answered"
            assert operation == "generate", f"round {round_index}: a broken {operation} request was accepted"
        except REFUSALS as error:
            outcome = f"{operation}: {type(error).__name__}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        unchanged()
    # Every operation was exercised and refused at least once.
    assert {key.split(":")[0] for key in outcomes if "Error" in key} == {"generate", "fwd_bwd", "checkpoint"}


def test_the_engines_still_train_and_load_after_everything(client: SyncArcticRLClient, checkpoint: Path) -> None:
    saved = _snapshot(client)
    client.fwd_bwd(_batch(client))
    stepped = client.step()
    client.sync_weights()
    assert client.weight_norm()["training_norm"] != saved["norms"]["training_norm"]
    assert client.load_checkpoint(str(checkpoint)) == saved["step"]
    assert stepped["step"] == saved["step"] + 1
    assert _snapshot(client) == saved
