"""The GRPO loop every recipe runs through the arctic-rl client, its typed settings, and the recipes' shared CLI.

One step: sample ``group_size`` completions of ``prompts_per_step`` prompts, score them with the task's reward,
build the GRPO batch, recompute the old log-probs, one ``fwd_bwd`` and optimizer ``step``, then sync the weights to
the sampler. A tqdm bar shows the reward, trajectories/s and the time split per step; at the end a summary is
printed and ``metrics.json`` (config, settings, every step, summary) is written to the run's directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from recipe_data import Example, PreparedData, RecipeDataError, Task, load_records, prepare_examples
from tqdm import tqdm

from arctic_rl import (
    ArcticRLClientConfig,
    FcaSection,
    PolicyLossConfig,
    SamplingConfig,
    StepTimer,
    SyncArcticRLClient,
    TrainingConfig,
    ZorroTrainSection,
    build_grpo_batch,
    create_arctic_rl_client,
)

__all__ = [
    "EngineOptions",
    "LoopSettings",
    "Recipe",
    "RecipeBuilder",
    "RunSummary",
    "StepRecord",
    "client_config",
    "engine_options",
    "loop_overrides",
    "prompt_batches",
    "recipe_arguments",
    "recipe_main",
    "run_recipe",
]

METRICS_FILE = "metrics.json"


@dataclass(frozen=True)
class LoopSettings:
    """What the loop does each step, and how often it evaluates.

    ``loss`` configures the policy loss named by ``loss_fn`` (``"grpo"`` or ``"gspo"``); ``eval_every`` 0 turns
    evaluation off (it also needs evaluation examples). Evaluation samples one completion per prompt at
    ``eval_temperature`` (0: greedy) for the first ``eval_prompts`` evaluation examples.
    """

    steps: int = 200
    prompts_per_step: int = 32
    group_size: int = 8
    max_prompt_tokens: int = 512
    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    loss_fn: Literal["grpo", "gspo"] = "grpo"
    loss: PolicyLossConfig = field(default_factory=lambda: PolicyLossConfig(clip_ratio_high=0.28))
    eval_every: int = 20
    eval_prompts: int = 128
    eval_temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        positive = {
            "steps": self.steps,
            "prompts_per_step": self.prompts_per_step,
            "group_size": self.group_size,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_tokens": self.max_tokens,
            "eval_prompts": self.eval_prompts,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"LoopSettings.{name} must be >= 1, got {value}.")
        if self.group_size < 2:
            raise ValueError(
                f"LoopSettings.group_size must be >= 2, got {self.group_size}: GRPO's advantages compare the samples "
                "of one prompt, so a group of one learns nothing."
            )
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"LoopSettings needs temperature > 0 and top_p in (0, 1] for training samples, got temperature "
                f"{self.temperature} and top_p {self.top_p}."
            )
        if self.eval_every < 0 or self.eval_temperature < 0:
            raise ValueError(
                f"LoopSettings.eval_every and eval_temperature must be >= 0, got {self.eval_every} and "
                f"{self.eval_temperature}."
            )

    def processing(self) -> dict[str, Any]:
        """The ``processing`` argument of ``client.fwd_bwd``: the loss's name and its options."""
        return {"loss_fn": self.loss_fn, "config": dataclasses.asdict(self.loss)}


@dataclass(frozen=True)
class Recipe:
    """A complete run: the engines' configuration and the loop's settings."""

    config: ArcticRLClientConfig
    loop: LoopSettings


@dataclass(frozen=True)
class EngineOptions:
    """Where the engines run: GPU counts, placement, the Ray cluster, the device and the seed."""

    tokenizer_name: str | None = None
    training_gpus: int = 1
    sampling_gpus: int = 1
    colocate: bool = False
    ray_address: str | None = None
    device: Literal["auto", "cuda", "cpu"] = "auto"
    seed: int = 0


def client_config(model_name: str, engines: EngineOptions, loop: LoopSettings, *, lr: float) -> ArcticRLClientConfig:
    """The recipes' engine configuration: ZoRRO on, FCA on, a constant learning rate, vLLM sized to the loop's
    lengths (prompt budget plus response budget).

    On the CPU vLLM's KV cache gets 1 GiB (its CPU build sizes it by that, not by a memory fraction).
    """
    device = engines.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return ArcticRLClientConfig(
        model_name=model_name,
        tokenizer_name=engines.tokenizer_name,
        comm_protocol="ray",
        training_gpus=engines.training_gpus,
        sampling_gpus=engines.sampling_gpus,
        log_prob_gpus=0,
        colocate=engines.colocate,
        ray_address=engines.ray_address,
        device=device,
        seed=engines.seed,
        training=TrainingConfig(lr=lr, max_grad_norm=1.0),
        zorro_train=ZorroTrainSection(enable=True),
        fca=FcaSection(enable=True),
        sampling=SamplingConfig(
            max_model_len=loop.max_prompt_tokens + loop.max_tokens, kv_cache_space_gib=1.0 if on_cpu else None
        ),
    )


class RecipeBuilder(Protocol):
    """A recipe's function: the model, where the engines run, the learning rate and the loop give a ``Recipe``."""

    def __call__(
        self, model_name: str, *, engines: EngineOptions = ..., lr: float = ..., loop: LoopSettings = ...
    ) -> Recipe: ...


@dataclass(frozen=True)
class StepRecord:
    """One step's outcome: rewards, throughput, where the time went (seconds, around the client's calls; reward
    includes building the batch) and the engines' own metrics of the step (``step()``'s: phase times, tokens/s,
    ZoRRO savings, FCA reads saved, the train/inference log-prob mismatch)."""

    step: int
    reward_mean: float
    eval_reward: float | None
    trajectories: int
    response_tokens_mean: float
    loss: float
    grad_norm: float
    dedup_savings: float | None
    seconds: float
    trajectories_per_s: float
    time_generate: float
    time_reward: float
    time_log_prob: float
    time_train: float
    time_sync: float
    engine_metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSummary:
    """The run at a glance: reward at the start and the end (mean over ``window`` steps), throughput, time split."""

    steps: int
    window: int
    reward_first: float
    reward_last: float
    eval_reward_last: float | None
    trajectories_per_s: float
    seconds: float
    time_generate: float
    time_reward: float
    time_log_prob: float
    time_train: float
    time_sync: float
    metrics_path: str

    def table(self) -> str:
        rows = [
            ("steps", f"{self.steps}"),
            (f"reward, first {self.window} steps", f"{self.reward_first:.3f}"),
            (f"reward, last {self.window} steps", f"{self.reward_last:.3f}"),
            ("eval reward, last", "-" if self.eval_reward_last is None else f"{self.eval_reward_last:.3f}"),
            ("trajectories/s", f"{self.trajectories_per_s:.2f}"),
            ("wall time", f"{self.seconds:.1f} s"),
            ("generate / reward / log-prob / train / sync", self._split()),
            ("metrics", self.metrics_path),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)

    def _split(self) -> str:
        parts = (self.time_generate, self.time_reward, self.time_log_prob, self.time_train, self.time_sync)
        return " / ".join(f"{seconds:.1f} s" for seconds in parts)


def prompt_batches(examples: Sequence[Example[Any]], size: int, seed: int) -> Iterator[list[Example[Any]]]:
    """Endless batches of ``size`` examples: each epoch a new seeded shuffle, every example once per epoch."""
    if len(examples) < size:
        raise RecipeDataError(
            f"{len(examples)} training prompts fit the token budget but a step takes {size}; lower "
            "--prompts-per-step, raise --max-prompt-tokens, or add data."
        )
    generator = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        generator.shuffle(order)
        for start in range(0, len(order) - size + 1, size):
            yield [examples[index] for index in order[start : start + size]]


ClientFactory = Callable[..., Any]


def run_recipe(
    recipe: Recipe,
    task: Task[Any],
    train: Sequence[Example[Any]],
    evaluation: Sequence[Example[Any]],
    *,
    pad_token_id: int,
    output_dir: Path,
    client_factory: ClientFactory = create_arctic_rl_client,
    show_progress: bool = True,
) -> RunSummary:
    """Run ``recipe.loop.steps`` GRPO steps of ``task`` on ``train``; write ``metrics.json`` into ``output_dir``."""
    loop = recipe.loop
    # Absolute, so that the printed summary and metrics.json name the run directory wherever they are read.
    output_dir = output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    batches = prompt_batches(train, loop.prompts_per_step, loop.seed)
    sampling = {
        "n": loop.group_size,
        "max_tokens": loop.max_tokens,
        "temperature": loop.temperature,
        "top_p": loop.top_p,
    }
    records: list[StepRecord] = []
    with client_factory(recipe.config, blocking_calls=True) as client:
        bar = tqdm(range(loop.steps), desc=task.name, unit="step", disable=not show_progress)
        for step in bar:
            batch_examples = next(batches)
            record = _one_step(client, recipe, task, batch_examples, step, sampling, pad_token_id)
            if evaluation and loop.eval_every and ((step + 1) % loop.eval_every == 0 or step + 1 == loop.steps):
                eval_reward = _evaluate(client, loop, task, evaluation, step)
                record = dataclasses.replace(record, eval_reward=eval_reward)
            records.append(record)
            bar.set_postfix_str(_postfix(record))
    summary = _summarize(records, output_dir / METRICS_FILE)
    _write_metrics(output_dir / METRICS_FILE, recipe, task.name, records, summary)
    return summary


def _one_step(
    client: SyncArcticRLClient,
    recipe: Recipe,
    task: Task[Any],
    examples: Sequence[Example[Any]],
    step: int,
    sampling: dict[str, Any],
    pad_token_id: int,
) -> StepRecord:
    # Timed here, around the client's calls (what the loop waits for, transfers included): the engines' own times
    # of a step also count an evaluation's generation that ran since the previous step.
    timer = StepTimer()
    prompts = [list(example.prompt_ids) for example in examples]
    with timer.phase("generate"):
        samples = client.generate(prompts, {**sampling, "seed": recipe.loop.seed + step})
    with timer.phase("reward"):
        rewards = [
            [task.reward(sample["text"], example.reference) for sample in group]
            for example, group in zip(examples, samples, strict=True)
        ]
        batch = build_grpo_batch(prompts, samples, rewards, pad_token_id=pad_token_id)
    with timer.phase("train"):
        if recipe.config.colocate:
            client.sleep_inference()
    with timer.phase("log_prob"):
        batch["old_log_probs"] = client.fwd_no_grad(batch)["logprobs"]
    with timer.phase("train"):
        result = client.fwd_bwd(batch, processing=recipe.loop.processing())
        stats = client.step()
    with timer.phase("sync"):
        if recipe.config.colocate:
            client.wake_inference()
        client.sync_weights()
    flat_rewards = [reward for group in rewards for reward in group]
    lengths = [len(sample["token_ids"]) for group in samples for sample in group]
    seconds = timer.metrics()["time/step"]
    engine_metrics = {key: float(value) for key, value in stats["metrics"].items()}
    return StepRecord(
        step=step,
        reward_mean=statistics.fmean(flat_rewards),
        eval_reward=None,
        trajectories=len(flat_rewards),
        response_tokens_mean=statistics.fmean(lengths),
        loss=float(result["loss"]),
        grad_norm=float(stats["grad_norm"]),
        dedup_savings=engine_metrics.get("zorro/savings"),
        seconds=seconds,
        trajectories_per_s=len(flat_rewards) / seconds,
        time_generate=timer.seconds("generate"),
        time_reward=timer.seconds("reward"),
        time_log_prob=timer.seconds("log_prob"),
        time_train=timer.seconds("train"),
        time_sync=timer.seconds("sync"),
        engine_metrics=engine_metrics,
    )


def _evaluate(
    client: SyncArcticRLClient, loop: LoopSettings, task: Task[Any], evaluation: Sequence[Example[Any]], step: int
) -> float:
    examples = evaluation[: loop.eval_prompts]
    params = {"n": 1, "max_tokens": loop.max_tokens, "temperature": loop.eval_temperature, "seed": loop.seed + step}
    samples = client.generate([list(example.prompt_ids) for example in examples], params)
    return statistics.fmean(
        task.reward(group[0]["text"], example.reference) for example, group in zip(examples, samples, strict=True)
    )


def _postfix(record: StepRecord) -> str:
    parts = [f"reward {record.reward_mean:.3f}"]
    if record.eval_reward is not None:
        parts.append(f"eval {record.eval_reward:.3f}")
    parts.append(f"{record.trajectories_per_s:.2f} traj/s")
    generated_per_s = record.engine_metrics.get("throughput/generate_tokens_per_s")
    if generated_per_s is not None:
        parts.append(f"{generated_per_s:.0f} gen tok/s")
    if record.dedup_savings is not None:
        parts.append(f"dedup {record.dedup_savings:.0%}")
    split = (record.time_generate, record.time_reward, record.time_log_prob, record.time_train, record.time_sync)
    parts.append("gen/reward/lp/train/sync " + "/".join(f"{seconds:.1f}" for seconds in split) + " s")
    return ", ".join(parts)


def _summarize(records: Sequence[StepRecord], metrics_path: Path) -> RunSummary:
    window = max(1, min(10, len(records) // 2))
    evaluated = [record.eval_reward for record in records if record.eval_reward is not None]
    seconds = sum(record.seconds for record in records)
    return RunSummary(
        steps=len(records),
        window=window,
        reward_first=statistics.fmean(record.reward_mean for record in records[:window]),
        reward_last=statistics.fmean(record.reward_mean for record in records[-window:]),
        eval_reward_last=evaluated[-1] if evaluated else None,
        trajectories_per_s=sum(record.trajectories for record in records) / seconds,
        seconds=seconds,
        time_generate=sum(record.time_generate for record in records),
        time_reward=sum(record.time_reward for record in records),
        time_log_prob=sum(record.time_log_prob for record in records),
        time_train=sum(record.time_train for record in records),
        time_sync=sum(record.time_sync for record in records),
        metrics_path=str(metrics_path),
    )


def _write_metrics(
    path: Path, recipe: Recipe, task_name: str, records: Sequence[StepRecord], summary: RunSummary
) -> None:
    document = {
        "recipe": task_name,
        "config": recipe.config.model_dump(mode="json"),
        "loop": dataclasses.asdict(recipe.loop),
        "steps": [dataclasses.asdict(record) for record in records],
        "summary": dataclasses.asdict(summary),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def recipe_arguments(description: str) -> argparse.ArgumentParser:
    """The recipes' common command line; loop options left unset keep the recipe's defaults."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--model", required=True, help="hub id or local directory of the policy model")
    data.add_argument("--tokenizer", help="tokenizer hub id or directory (default: the model's)")
    data.add_argument("--data", required=True, help="hub dataset id, local dataset directory, .jsonl or .parquet")
    data.add_argument("--data-subset", help="the hub dataset's configuration name (e.g. 'main' for openai/gsm8k)")
    data.add_argument("--split", default="train", help="split of a hub dataset (default: train)")
    data.add_argument("--eval-data", help="evaluation data, as --data (default: no evaluation)")
    data.add_argument("--eval-split", default="test", help="split of a hub evaluation dataset (default: test)")
    data.add_argument("--limit", type=int, help="read at most this many training records")
    data.add_argument("--output", type=Path, help="run directory for metrics.json (default: runs/<recipe>-<time>)")
    loop = parser.add_argument_group("loop (default: the recipe's)")
    for name, kind in (
        ("steps", int),
        ("prompts-per-step", int),
        ("group-size", int),
        ("max-prompt-tokens", int),
        ("max-tokens", int),
        ("temperature", float),
        ("eval-every", int),
        ("eval-prompts", int),
        ("seed", int),
    ):
        loop.add_argument(f"--{name}", type=kind)
    engines = parser.add_argument_group("engines")
    engines.add_argument("--lr", type=float, help="peak learning rate (default: the recipe's)")
    engines.add_argument("--training-gpus", type=int, default=1)
    engines.add_argument("--sampling-gpus", type=int, default=1)
    engines.add_argument("--colocate", action="store_true", help="time-share the same GPUs between the engines")
    engines.add_argument("--ray-address", help="address of a running Ray cluster ('auto' after `ray start`)")
    engines.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    return parser


def loop_overrides(arguments: argparse.Namespace) -> dict[str, Any]:
    """The loop settings given on the command line (``--max-tokens 256`` -> ``{"max_tokens": 256}``)."""
    names = [field.name for field in dataclasses.fields(LoopSettings)]
    return {name: getattr(arguments, name) for name in names if getattr(arguments, name, None) is not None}


def engine_options(arguments: argparse.Namespace) -> EngineOptions:
    """The engine options given on the command line."""
    seed = arguments.seed if arguments.seed is not None else 0
    return EngineOptions(
        tokenizer_name=arguments.tokenizer,
        training_gpus=arguments.training_gpus,
        sampling_gpus=arguments.sampling_gpus,
        colocate=arguments.colocate,
        ray_address=arguments.ray_address,
        device=arguments.device,
        seed=seed,
    )


def recipe_main(
    argv: Sequence[str] | None,
    *,
    description: str,
    build: RecipeBuilder,
    default_loop: LoopSettings,
    task: Callable[[argparse.Namespace], Task[Any]],
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> RunSummary:
    """A recipe's ``main``: parse the command line, build the recipe, load the data, build the prompts with the
    model's tokenizer, run the loop and print the summary."""
    from transformers import AutoTokenizer

    parser = recipe_arguments(description)
    if add_arguments is not None:
        add_arguments(parser)
    arguments = parser.parse_args(argv)
    loop = dataclasses.replace(default_loop, **loop_overrides(arguments))
    learning_rate = {} if arguments.lr is None else {"lr": arguments.lr}
    recipe = build(arguments.model, engines=engine_options(arguments), loop=loop, **learning_rate)
    the_task = task(arguments)
    tokenizer = AutoTokenizer.from_pretrained(recipe.config.resolved_tokenizer_name())
    train = _prepared(arguments.data, arguments.split, arguments, the_task, tokenizer, loop, "training")
    evaluation: tuple[Example[Any], ...] = ()
    if arguments.eval_data:
        evaluation = _prepared(arguments.eval_data, arguments.eval_split, arguments, the_task, tokenizer, loop, "eval")
    output = arguments.output or Path("runs") / f"{the_task.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    summary = run_recipe(recipe, the_task, train, evaluation, pad_token_id=pad_token_id, output_dir=output)
    print(summary.table())
    return summary


def _prepared(
    source: str,
    split: str,
    arguments: argparse.Namespace,
    task: Task[Any],
    tokenizer: Any,
    loop: LoopSettings,
    role: str,
) -> tuple[Example[Any], ...]:
    records = load_records(source, split=split, subset=arguments.data_subset, limit=arguments.limit)
    prepared: PreparedData[Any] = prepare_examples(records, task, tokenizer, max_prompt_tokens=loop.max_prompt_tokens)
    print(
        f"{role} data: {len(prepared.examples)} prompts of {len(records)} records from {source} "
        f"({prepared.dropped_too_long} longer than {loop.max_prompt_tokens} tokens dropped)"
    )
    if not prepared.examples:
        raise RecipeDataError(
            f"every {role} prompt of {source} is longer than --max-prompt-tokens {loop.max_prompt_tokens}; raise it."
        )
    return prepared.examples
