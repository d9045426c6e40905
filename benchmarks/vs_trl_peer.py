"""The TRL side of ``vs_trl.py``: TRL's ``GRPOTrainer`` on the main job's parity task, in TRL's own environment.

Imports only trl, transformers, torch and datasets (and only after the arguments are parsed, so ``--help`` works
without them). ``vs_trl.py`` writes the settings file (the model directory it saved, the prompts of every step in
order, and the ``GRPOConfig`` arguments it translated from the main job's settings) and reads back the file this
script writes: TRL's version, the wall time of set-up and of the run, and one row per step (mean reward, seconds,
trajectories, response tokens).

    python benchmarks/vs_trl_peer.py --settings settings.json --out trl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def parity_reward(parity: str, token_ids: list[int]) -> float:
    """The main job's reward, restated here because this environment cannot import the recipes: the share of the
    response's byte tokens (ids < 256) with the asked parity; 0 for an empty response. ``vs_trl.py``'s tests check
    it against the main job's on fixed completions."""
    if parity not in ("even", "odd"):
        raise ValueError(f"parity must be 'even' or 'odd', got {parity!r}.")
    if not token_ids:
        return 0.0
    wanted = 0 if parity == "even" else 1
    return sum(1 for token in token_ids if token < 256 and token % 2 == wanted) / len(token_ids)


class StepLog:
    """What one run records: the rewards of each ``GRPOTrainer`` reward call (one call per step here, as the
    generation batch is the step's batch), the wall time of each optimizer step, and how far into the step the
    reward call came (``generate``: TRL generates, then scores, then trains; with ``num_iterations=1`` and no KL it
    runs no other forward before the reward)."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self.step_start = clock()
        self.rewards: list[list[float]] = []
        self.response_tokens: list[int] = []
        self.generate_seconds: list[float] = []
        self.seconds: list[float] = []

    def reward_function(self) -> Any:
        """The reward function to give ``GRPOTrainer`` (TRL logs it under its ``__name__``, ``parity``)."""

        def parity(completions: list[Any], completion_ids: list[list[int]], **columns: Any) -> list[float]:
            # TRL passes the completion's ids up to and including the first end-of-text token, as the main job's
            # sampler returns them, and every dataset column by name (here ``parity``).
            self.generate_seconds.append(self.clock() - self.step_start)
            rewards = [parity_reward(asked, ids) for asked, ids in zip(columns["parity"], completion_ids, strict=True)]
            self.rewards.append(rewards)
            self.response_tokens.append(sum(len(ids) for ids in completion_ids))
            return rewards

        return parity

    def rows(self) -> list[dict[str, Any]]:
        if not len(self.rewards) == len(self.seconds):
            raise RuntimeError(
                f"TRL made {len(self.rewards)} reward calls in {len(self.seconds)} steps; the comparison needs one "
                "generation batch per step (steps_per_generation=1, num_iterations=1)."
            )
        return [
            {
                "step": step,
                "reward": statistics.fmean(rewards),
                "seconds": seconds,
                "trajectories": len(rewards),
                "response_tokens": tokens,
                "phases": {"generate": generate, "train": seconds - generate},
            }
            for step, (rewards, seconds, tokens, generate) in enumerate(
                zip(self.rewards, self.seconds, self.response_tokens, self.generate_seconds, strict=True)
            )
        ]


def run(settings: dict[str, Any]) -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import trl

    log = StepLog()

    class StepTimer(transformers.TrainerCallback):
        # An optimizer step of GRPOTrainer generates, scores and trains, so its wall time is the step's.
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            log.step_start = log.clock()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            log.seconds.append(log.clock() - log.step_start)

    start = time.perf_counter()
    torch.set_num_threads(settings["threads"])
    dataset = datasets.Dataset.from_list([{"prompt": text, "parity": parity} for text, parity in settings["prompts"]])
    with tempfile.TemporaryDirectory() as scratch:
        config = trl.GRPOConfig(output_dir=scratch, **settings["grpo_config"])
        trainer = trl.GRPOTrainer(
            model=settings["model_dir"],
            reward_funcs=log.reward_function(),
            args=config,
            train_dataset=dataset,
            callbacks=[StepTimer()],
        )
        setup_seconds = time.perf_counter() - start
        trainer.train()
    return {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "setup_seconds": setup_seconds,
        "wall_seconds": time.perf_counter() - start,
        "optimizer": type(trainer.optimizer).__name__,
        "rows": log.rows(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", type=Path, required=True, help="the JSON file vs_trl.py wrote")
    parser.add_argument("--out", type=Path, required=True, help="where to write the per-step results (JSON)")
    args = parser.parse_args(argv)
    result = run(json.loads(args.settings.read_text()))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
