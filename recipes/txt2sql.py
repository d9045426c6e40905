"""Text-to-SQL (BIRD-style) with GRPO: rewarded by executing the model's query on the SQLite database.

Records have ``question``, ``db_id``, the gold query (``SQL`` as in BIRD, or ``query`` / ``sql``) and optionally
``evidence`` (BIRD's hint). Databases sit at ``<db-root>/<db_id>/<db_id>.sqlite`` (BIRD's and Spider's layout).
The prompt shows the database's schema (its CREATE statements); the model answers with one query in a ```sql block.

Reward: 1.0 when the query's result equals the gold query's (as a multiset of rows, or in order when the gold has
ORDER BY); ``FORMAT_REWARD`` when the query compiles on the database but its result differs, fails or times out;
0 when there is no ```sql block or it does not compile. Queries run read-only with a time and row limit
(``sql_execution``).

    python recipes/txt2sql.py --model Qwen/Qwen2.5-Coder-7B-Instruct --data bird/train.jsonl \\
        --db-root bird/train_databases --eval-data bird/dev.jsonl
"""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipe_data import Messages, RecipeDataError, Record, Task, require_fields
from recipe_loop import EngineOptions, LoopSettings, Recipe, RunSummary, client_config, recipe_main
from sql_execution import SqlError, SqlLimits, compiles, execute_readonly, has_order_by, open_readonly, results_match

__all__ = [
    "FORMAT_REWARD",
    "TXT2SQL_LOOP",
    "SqlReference",
    "database_schema",
    "extract_sql",
    "main",
    "txt2sql_recipe",
    "txt2sql_task",
]

FORMAT_REWARD = 0.1
GOLD_FIELDS = ("SQL", "query", "sql")

TXT2SQL_LOOP = LoopSettings(
    steps=300,
    prompts_per_step=32,
    group_size=8,
    max_prompt_tokens=4096,
    max_tokens=512,
    temperature=1.0,
    eval_every=25,
    eval_prompts=256,
)

_SQL_BLOCK = re.compile(r"```sql\s*\n?(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class SqlReference:
    """Where a record's query runs and what it must return."""

    database: str
    gold_sql: str


def txt2sql_recipe(
    model_name: str, *, engines: EngineOptions | None = None, lr: float = 1e-6, loop: LoopSettings = TXT2SQL_LOOP
) -> Recipe:
    """The Txt2SQL run: the engines (ZoRRO and FCA on) and the loop settings."""
    engines = engines or EngineOptions()
    return Recipe(client_config(model_name, engines, loop, lr=lr), loop)


@functools.lru_cache(maxsize=256)
def database_schema(database: str) -> str:
    """The CREATE statements of ``database``'s tables, in name order (what the prompt shows)."""
    connection = open_readonly(database)
    try:
        rows = connection.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL AND name NOT LIKE 'sqlite_%' "
            "ORDER BY name"
        ).fetchall()
    finally:
        connection.close()
    return "\n\n".join(f"{row[0].strip()};" for row in rows)


def extract_sql(completion: str) -> str | None:
    """The query in the completion's last ```sql block, without a trailing semicolon; None if there is none."""
    blocks = _SQL_BLOCK.findall(completion)
    if not blocks:
        return None
    sql = blocks[-1].strip().rstrip(";").strip()
    return sql or None


def txt2sql_task(db_root: str | Path, limits: SqlLimits | None = None) -> Task[SqlReference]:
    """The Txt2SQL task over the databases under ``db_root``, running queries within ``limits``."""
    root = Path(db_root)
    query_limits = limits or SqlLimits()

    def reference(record: Record) -> SqlReference:
        require_fields(record, ["question", "db_id"], "Txt2SQL")
        gold = next((str(record[name]) for name in GOLD_FIELDS if name in record), None)
        if gold is None:
            raise RecipeDataError(
                f"a Txt2SQL record needs its gold query in one of {list(GOLD_FIELDS)}; this one has {sorted(record)}."
            )
        database = root / str(record["db_id"]) / f"{record['db_id']}.sqlite"
        if not database.is_file():
            raise RecipeDataError(f"no database for db_id {record['db_id']!r} at {database}; check --db-root.")
        return SqlReference(str(database), gold)

    def messages(record: Record) -> Messages:
        database = reference(record).database
        hint = f"\n\nHint: {record['evidence']}" if record.get("evidence") else ""
        content = (
            f"SQLite database schema:\n\n{database_schema(database)}\n\nQuestion: {record['question']}{hint}\n\n"
            "Write one SQLite query that answers the question. Give it in a ```sql code block."
        )
        return [{"role": "user", "content": content}]

    def reward(completion: str, expected: SqlReference) -> float:
        sql = extract_sql(completion)
        if sql is None or not compiles(expected.database, sql):
            return 0.0
        try:
            predicted = execute_readonly(expected.database, sql, query_limits)
        except SqlError:
            return FORMAT_REWARD
        gold = _gold_rows(expected.database, expected.gold_sql, query_limits)
        return 1.0 if results_match(predicted, gold, ordered=has_order_by(expected.gold_sql)) else FORMAT_REWARD

    return Task("txt2sql", messages, reference, reward)


@functools.lru_cache(maxsize=4096)
def _gold_rows(database: str, gold_sql: str, limits: SqlLimits) -> list[tuple[Any, ...]]:
    try:
        return execute_readonly(database, gold_sql, limits)
    except SqlError as error:
        raise RecipeDataError(
            f"the gold query {gold_sql!r} fails on {database}: {error}; drop the record or raise --sql-timeout / "
            "--row-limit."
        ) from error


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    sql = parser.add_argument_group("sql")
    sql.add_argument("--db-root", type=Path, required=True, help="folder holding <db_id>/<db_id>.sqlite")
    sql.add_argument("--sql-timeout", type=float, default=SqlLimits.timeout_s, help="seconds per query")
    sql.add_argument("--row-limit", type=int, default=SqlLimits.row_limit, help="most rows a query may return")


def main(argv: Sequence[str] | None = None) -> RunSummary:
    def task(arguments: argparse.Namespace) -> Task[Any]:
        return txt2sql_task(arguments.db_root, SqlLimits(arguments.sql_timeout, arguments.row_limit))

    return recipe_main(
        argv,
        description=__doc__ or "",
        build=txt2sql_recipe,
        default_loop=TXT2SQL_LOOP,
        task=task,
        add_arguments=_add_arguments,
    )


if __name__ == "__main__":
    main()
