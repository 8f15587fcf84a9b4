"""Arrow schemas of the data that moves between stages, and atomic Parquet IO.

A stage's output for one (run, step, stage, group, wave) is one Parquet object,
written atomically, so a retried or resumed task rewrites it whole. Every sample
carries stable ids — ``prompt_id``, ``sample_index``, ``policy_version`` — through every
stage, so one can ask which samples trained which step.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from storage import objectstore

PROMPTS = pa.schema(
    [
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("answer", pa.string()),  # reference answer for rule rewards; may be null
        # optional image bytes (vision-language prompts); files without the column load with nulls
        pa.field("image", pa.binary()),
    ]
)

ROLLOUTS = pa.schema(
    [
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("wave", pa.int32(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("answer", pa.string()),
        pa.field("image", pa.binary()),  # the prompt's image, carried through every stage (null: text only)
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
    ]
)

SCORED = ROLLOUTS.append(pa.field("judge_text", pa.string())).append(pa.field("genrm_reward", pa.float32())).append(
    pa.field("rule_reward", pa.float32())
).append(pa.field("reward", pa.float32(), nullable=False))

EXPERIENCE = SCORED.append(pa.field("advantage", pa.float32(), nullable=False))

# Kept prompt groups beyond a step's target, carried over to the next step's batch (dynamic
# sampling): the scored samples and the step that generated them (``policy_version`` is the
# policy of that step, whose log-probs they hold).
CARRY = SCORED.append(pa.field("step", pa.int64(), nullable=False))


class SchemaError(ValueError):
    """A dataset does not match its schema; the message names the file and the field."""


def check_schema(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """The columns of ``schema`` (extra columns are dropped), cast to its types."""
    for field in schema:
        if field.name not in table.column_names:
            if field.nullable:
                table = table.append_column(field.name, pa.nulls(len(table), field.type))
                continue
            raise SchemaError(f"{where}: missing field '{field.name}' ({field.type})")
        column = table.column(field.name)
        if not field.nullable and column.null_count:
            raise SchemaError(f"{where}: field '{field.name}' has {column.null_count} null value(s)")
        if column.type != field.type:
            try:
                table = table.set_column(table.schema.get_field_index(field.name), field.name, column.cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SchemaError(f"{where}: field '{field.name}' has type {column.type}, expected {field.type}") from e
    return table.select(schema.names).cast(schema)


def write_table(uri: str, table: pa.Table, schema: pa.Schema) -> None:
    """Validate against ``schema`` and write one Parquet object atomically."""
    table = check_schema(table, schema, uri)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    objectstore.write_bytes(uri, buf.getvalue())


def write_rows(uri: str, rows: list[dict], schema: pa.Schema) -> None:
    """``rows`` (dicts with the schema's fields) as one Parquet object, atomically."""
    write_table(uri, pa.Table.from_pylist(rows, schema=schema), schema)


def read_table(uri: str, schema: pa.Schema) -> pa.Table:
    """Read a Parquet object, or every ``.parquet`` object of a folder in name order."""
    parts = objectstore.list_files(uri, suffix=".parquet")
    if not parts:
        raise SchemaError(f"{uri}: no .parquet files")
    tables = []
    for part in parts:
        try:
            table = pq.read_table(io.BytesIO(objectstore.read_bytes(part)))
        except pa.ArrowInvalid as e:
            raise SchemaError(f"{part}: not a readable Parquet file ({e})") from e
        tables.append(check_schema(table, schema, part))
    return pa.concat_tables(tables)


def part_files(uri: str) -> list[list]:
    """``[file name, rows]`` of each part of a dataset, in the order ``read_table`` reads them."""
    files = []
    for part in objectstore.list_files(uri, suffix=".parquet"):
        fs, path = objectstore.fs_for(part)
        with fs.open(path, "rb") as f:
            files.append([part.rsplit("/", 1)[-1], pq.ParquetFile(f).metadata.num_rows])
    return files


def stage_uri(run_uri: str, step: int, stage: str, group: int, wave: int | None = None) -> str:
    """``{run}/steps/{step}/{stage}/group={g}/part-{wave}.parquet``: one object per task output."""
    name = f"part-{wave:03d}.parquet" if wave is not None else "part-000.parquet"
    return objectstore.join(run_uri, "steps", f"{step:06d}", stage, f"group={group}", name)
