"""Running model-written SQL safely on SQLite: read-only, one statement, a time limit and a row limit.

Three guards keep a query from changing the database: the file is opened read-only (``file:...?mode=ro``),
``PRAGMA query_only`` is on, and an authorizer refuses at compile time every action but reading (no writes, no
ATTACH, no PRAGMA). A progress handler interrupts a query past its deadline; a result longer than the row limit is
refused rather than truncated (a truncated result could match the gold by accident).
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "SqlError",
    "SqlLimits",
    "SqlTimeout",
    "compiles",
    "execute_readonly",
    "has_order_by",
    "open_readonly",
    "results_match",
]

Row = tuple[Any, ...]

# The authorizer's action codes a read-only query needs; everything else is denied when the statement compiles.
_READ_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


@dataclass(frozen=True)
class SqlLimits:
    """Per-query limits: wall-clock seconds, rows returned, and how many SQLite VM steps pass between deadline
    checks (smaller checks more often)."""

    timeout_s: float = 5.0
    row_limit: int = 10_000
    check_every_steps: int = 1_000

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.row_limit < 1 or self.check_every_steps < 1:
            raise ValueError(
                f"SqlLimits needs timeout_s > 0, row_limit >= 1 and check_every_steps >= 1, got {self.timeout_s}, "
                f"{self.row_limit} and {self.check_every_steps}."
            )


class SqlError(Exception):
    """The query could not run: it does not compile, writes, is not one statement, or returns too many rows."""


class SqlTimeout(SqlError):
    """The query ran past ``SqlLimits.timeout_s`` and was interrupted."""


def _read_only_authorizer(action: int, *_: str | None) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


def open_readonly(database: str | Path) -> sqlite3.Connection:
    """A connection to ``database`` that cannot change it (read-only file, ``query_only``, read-only authorizer)."""
    path = Path(database).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no SQLite database at {path}; check --db-root and the record's db_id.")
    connection = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    connection.execute("PRAGMA query_only = ON")
    connection.set_authorizer(_read_only_authorizer)
    return connection


def execute_readonly(database: str | Path, sql: str, limits: SqlLimits) -> list[Row]:
    """The rows of ``sql`` on ``database``; ``SqlTimeout`` past the deadline, ``SqlError`` for any other failure."""
    connection = open_readonly(database)
    deadline = time.monotonic() + limits.timeout_s
    connection.set_progress_handler(lambda: int(time.monotonic() > deadline), limits.check_every_steps)
    try:
        rows = connection.execute(sql).fetchmany(limits.row_limit + 1)
    except (sqlite3.Error, sqlite3.Warning) as error:
        if time.monotonic() > deadline:
            raise SqlTimeout(f"the query ran longer than {limits.timeout_s} s and was interrupted") from error
        raise SqlError(str(error)) from error
    finally:
        connection.close()
    if len(rows) > limits.row_limit:
        raise SqlError(f"the query returns more than {limits.row_limit} rows")
    return [tuple(row) for row in rows]


def compiles(database: str | Path, sql: str) -> bool:
    """Whether ``sql`` is one read-only statement that SQLite compiles against ``database``'s schema (not run)."""
    connection = open_readonly(database)
    try:
        connection.execute(f"EXPLAIN {sql}")
    except (sqlite3.Error, sqlite3.Warning):
        return False
    finally:
        connection.close()
    return True


def has_order_by(sql: str) -> bool:
    """Whether the query sorts its result (then row order is part of the answer)."""
    return _ORDER_BY.search(sql) is not None


def results_match(predicted: Sequence[Row], gold: Sequence[Row], *, ordered: bool) -> bool:
    """Equal as lists when ``ordered``, else as multisets of rows (duplicates count)."""
    if ordered:
        return list(predicted) == list(gold)
    return Counter(predicted) == Counter(gold)
