"""Txt2SQL on a real SQLite database made in the test: the schema in the prompt, execution match (multiset, or
ordered when the gold sorts), the format reward, and the guards: a slow query times out, a write fails and leaves
the database unchanged, too many rows are refused."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from recipe_data import RecipeDataError, load_records, prepare_examples
from recipe_fixtures import chat_tokenizer, expected_prompt_ids
from sql_execution import SqlError, SqlLimits, SqlTimeout, compiles, execute_readonly, open_readonly, results_match
from txt2sql import FORMAT_REWARD, SqlReference, database_schema, extract_sql, txt2sql_recipe, txt2sql_task

SCHEMA = [
    "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT, age INTEGER)",
    "CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, singer_id INTEGER REFERENCES singer(singer_id), "
    "year INTEGER, attendance INTEGER)",
]
SINGERS = [
    (1, "Joe Sharp", "Netherlands", 52),
    (2, "Timbaland", "United States", 32),
    (3, "Justin Brown", "France", 29),
    (4, "Rose White", "France", 41),
]
CONCERTS = [(1, 1, 2014, 1200), (2, 2, 2014, 3000), (3, 2, 2015, 2500), (4, 3, 2015, 800), (5, 4, 2015, 800)]
# A recursive count to a billion: many seconds of work for SQLite, so it must be interrupted.
SLOW_QUERY = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000000) SELECT max(i) FROM n"
FAST = SqlLimits(timeout_s=0.3, row_limit=3)

RECORDS = [
    {
        "db_id": "concerts",
        "question": "Which singers are from France?",
        "evidence": "country is the singer's country of origin",
        "SQL": "SELECT name FROM singer WHERE country = 'France'",
    },
    {
        "db_id": "concerts",
        "question": "List the concert years by total attendance, largest first.",
        "SQL": "SELECT year, SUM(attendance) FROM concert GROUP BY year ORDER BY SUM(attendance) DESC",
    },
]


@pytest.fixture
def db_root(tmp_path: Path) -> Path:
    database = tmp_path / "databases" / "concerts" / "concerts.sqlite"
    database.parent.mkdir(parents=True)
    connection = sqlite3.connect(database)
    for statement in SCHEMA:
        connection.execute(statement)
    connection.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", SINGERS)
    connection.executemany("INSERT INTO concert VALUES (?, ?, ?, ?)", CONCERTS)
    connection.commit()
    connection.close()
    return tmp_path / "databases"


def database_of(root: Path) -> str:
    return str(root / "concerts" / "concerts.sqlite")


def answer(sql: str) -> str:
    return f"The query is:\n```sql\n{sql};\n```"


def test_extract_sql_takes_the_last_sql_block() -> None:
    assert extract_sql("```sql\nSELECT 1\n```\nbetter:\n```SQL\nSELECT 2;\n```") == "SELECT 2"
    assert extract_sql("SELECT 1") is None
    assert extract_sql("```sql\n;\n```") is None


def test_gold_results_and_matching(db_root: Path) -> None:
    database = database_of(db_root)
    limits = SqlLimits()
    assert execute_readonly(database, RECORDS[1]["SQL"], limits) == [(2014, 4200), (2015, 4100)]
    assert sorted(execute_readonly(database, RECORDS[0]["SQL"], limits)) == [("Justin Brown",), ("Rose White",)]
    assert results_match([(1,), (2,), (2,)], [(2,), (1,), (2,)], ordered=False)
    assert not results_match([(1,), (2,)], [(1,), (2,), (2,)], ordered=False)
    assert not results_match([(2,), (1,)], [(1,), (2,)], ordered=True)


def test_reward_is_execution_match_with_a_format_reward(db_root: Path) -> None:
    task = txt2sql_task(db_root, SqlLimits())
    unordered, ordered = (task.reference(record) for record in RECORDS)
    assert unordered == SqlReference(database_of(db_root), RECORDS[0]["SQL"])
    # Same rows in another order (Rose before Justin): the gold has no ORDER BY, so it matches.
    assert (
        task.reward(
            answer("SELECT name FROM singer WHERE age < 45 AND country LIKE 'Fr%' ORDER BY age DESC"), unordered
        )
        == 1.0
    )
    # A duplicate row changes the multiset.
    doubled = "SELECT s.name FROM singer s JOIN concert c USING (singer_id) WHERE s.country = 'France'"
    assert task.reward(answer(doubled + " UNION ALL SELECT 'Rose White'"), unordered) == FORMAT_REWARD
    # The gold sorts: the ascending order is wrong, the descending one right.
    by_year = "SELECT year, SUM(attendance) FROM concert GROUP BY year ORDER BY SUM(attendance)"
    assert task.reward(answer(by_year), ordered) == FORMAT_REWARD
    assert task.reward(answer(by_year + " DESC"), ordered) == 1.0
    # Parses against the schema but answers something else; then a query on a column that does not exist.
    assert task.reward(answer("SELECT name FROM singer"), unordered) == FORMAT_REWARD
    assert task.reward(answer("SELECT nationality FROM singer"), unordered) == 0.0
    assert task.reward("SELECT name FROM singer WHERE country = 'France'", unordered) == 0.0
    assert task.reward(answer("SELEC name FROM singer"), unordered) == 0.0


def test_a_slow_query_times_out(db_root: Path) -> None:
    database = database_of(db_root)
    started = time.monotonic()
    with pytest.raises(SqlTimeout, match=r"longer than 0\.3 s"):
        execute_readonly(database, SLOW_QUERY, FAST)
    assert time.monotonic() - started < 3.0
    task = txt2sql_task(db_root, FAST)
    # It compiles, so it earns the format reward only.
    assert task.reward(answer(SLOW_QUERY), task.reference(RECORDS[0])) == FORMAT_REWARD


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO singer VALUES (9, 'Intruder', 'Nowhere', 1)",
        "UPDATE singer SET age = 0",
        "DELETE FROM concert",
        "DROP TABLE concert",
        "CREATE TABLE loot (x)",
        "PRAGMA query_only = OFF",
        "SELECT 1; DELETE FROM concert",
    ],
)
def test_a_query_that_writes_fails_and_changes_nothing(db_root: Path, statement: str) -> None:
    database = database_of(db_root)
    before = Path(database).read_bytes()
    with pytest.raises(SqlError):
        execute_readonly(database, statement, SqlLimits())
    assert not compiles(database, statement)
    task = txt2sql_task(db_root)
    assert task.reward(answer(statement), task.reference(RECORDS[0])) == 0.0
    assert Path(database).read_bytes() == before
    assert execute_readonly(database, "SELECT COUNT(*) FROM concert", SqlLimits()) == [(5,)]


def test_the_file_is_read_only_even_without_the_authorizer(db_root: Path) -> None:
    connection = open_readonly(database_of(db_root))
    connection.set_authorizer(None)
    connection.execute("PRAGMA query_only = OFF")
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        connection.execute("DELETE FROM concert")
    connection.close()


def test_attaching_another_database_is_refused(db_root: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.sqlite"
    with pytest.raises(SqlError, match="not authorized"):
        execute_readonly(database_of(db_root), f"ATTACH DATABASE '{other}' AS other", SqlLimits())
    assert not other.exists()


def test_more_rows_than_the_limit_are_refused(db_root: Path) -> None:
    database = database_of(db_root)
    assert len(execute_readonly(database, "SELECT * FROM singer LIMIT 3", FAST)) == 3
    with pytest.raises(SqlError, match="more than 3 rows"):
        execute_readonly(database, "SELECT * FROM concert", FAST)


def test_data_path_prompt_shows_schema_question_and_hint(db_root: Path, tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    task = txt2sql_task(db_root)
    schema = ";\n\n".join(SCHEMA[::-1]) + ";"
    assert database_schema(database_of(db_root)) == schema
    prepared = prepare_examples(load_records(str(path)), task, chat_tokenizer(), max_prompt_tokens=4096)
    content = (
        f"SQLite database schema:\n\n{schema}\n\nQuestion: Which singers are from France?\n\n"
        "Hint: country is the singer's country of origin\n\n"
        "Write one SQLite query that answers the question. Give it in a ```sql code block."
    )
    assert list(prepared.examples[0].prompt_ids) == expected_prompt_ids(content)
    assert "Hint:" not in prepared.examples[1].prompt_text
    with pytest.raises(RecipeDataError, match="no database for db_id 'missing'"):
        task.reference({**RECORDS[0], "db_id": "missing"})
    with pytest.raises(RecipeDataError, match="gold query"):
        task.reference({"db_id": "concerts", "question": "?"})


def test_recipe_config_fits_schema_prompts() -> None:
    recipe = txt2sql_recipe("Qwen/Qwen2.5-Coder-7B-Instruct")
    assert recipe.config.sampling.max_model_len == 4096 + 512
    assert recipe.config.zorro_train.enable and recipe.config.fca.enable
