"""Arrow schemas of the data that moves between stages, and atomic Parquet IO.

A stage's output for one (run, step, stage, group, wave) is one Parquet object,
written atomically, so a retried or resumed task rewrites it whole. Every sample
carries stable ids — ``prompt_id``, ``sample_index``, ``policy_version`` — through every
stage, so one can ask which samples trained which step.
"""

from __future__ import annotations

import bisect
import io
import operator
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from storage import objectstore

# A chat conversation: the turns before the model's answer (``engines/backends/chat.py`` renders
# them with the model's chat template). Extra keys of a turn (e.g. Hugging Face datasets' others) are dropped.
MESSAGES = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))

PROMPTS = pa.schema(
    [
        pa.field("prompt_id", pa.int64(), nullable=False),
        # the prompt as plain text; a file may have ``messages`` instead (or both: the messages are
        # what the model sees, the text what the reward rule and the judge read)
        pa.field("prompt", pa.string()),
        pa.field("messages", MESSAGES),
        pa.field("answer", pa.string()),  # reference answer for rule rewards; may be null
        # encoded images (PNG/JPEG bytes) of a vision-language prompt; files without the column
        # (text-only prompts) load with nulls
        pa.field("images", pa.list_(pa.binary())),
        # encoded videos (MP4/WebM bytes), '<video>' in the prompt once per clip: decoded on the host
        # into frames that become images of the prompt (engines/backends/video.py); null without the column
        pa.field("videos", pa.list_(pa.binary())),
    ],
    metadata={"one_of": "prompt,messages"},  # a file has at least one of these columns (check_schema)
)

# A preference dataset (``data.preferences``, offline DPO): a prompt and two responses to it, the
# preferred first; read instead of the prompts, its two responses are a step's samples of the prompt.
PREFERENCES = PROMPTS.append(pa.field("chosen", pa.string(), nullable=False)).append(pa.field("rejected", pa.string(), nullable=False))

ROLLOUTS = pa.schema(
    [
        pa.field("prompt_id", pa.int64(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("wave", pa.int32(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("answer", pa.string()),
        # the prompt's global row in the prompts dataset (``PromptReader`` order), by which a trainer
        # re-reads its images: samples reference images, never copy them (null: not recorded)
        pa.field("prompt_row", pa.int64()),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
        # a mixture-of-experts policy under train.router_replay: per token the rollout fed, per MoE layer, the
        # experts it took (engines/backends/torch/routing.py); null otherwise
        pa.field("routed_experts", pa.list_(pa.int16())),
        # rollout.mode=stream: per response token, the policy version that sampled it (a sample continued across a
        # weight update mixes versions; ``policy_version`` is its oldest); null for a sample of one version
        pa.field("token_versions", pa.list_(pa.int32())),
        # an episode (rollout.env / rollout.tools, engines/agents): ``response_ids`` are its assistant turns as
        # sampled and the observations between them, ``logprobs`` 0 at observations; null for a single-turn sample
        pa.field("loss_mask", pa.list_(pa.int8())),  # per response token: 1 sampled by the policy, 0 an observation
        pa.field("turns", pa.int32()),
        pa.field("tool_calls", pa.int32()),
        pa.field("tool_errors", pa.int32()),  # calls answered with an error (unknown tool, bad JSON, raised, timed out)
        pa.field("tool_s", pa.float32()),  # seconds its tools ran
        pa.field("env_reward", pa.float32()),  # the sum of the environment's rewards (null: it gave none)
    ]
)

SCORED = ROLLOUTS.append(pa.field("judge_text", pa.string())).append(pa.field("genrm_reward", pa.float32())).append(
    pa.field("rule_reward", pa.float32())
).append(pa.field("format_reward", pa.float32())).append(pa.field("rm_reward", pa.float32())).append(
    pa.field("reward", pa.float32(), nullable=False))

EXPERIENCE = SCORED.append(pa.field("advantage", pa.float32(), nullable=False)).append(
    # an algorithm with a critic (engines/host/critic.py): per response token (an episode's: per
    # sampled token, its loss_mask's ones), the advantages, the critic's targets and the values they
    # were computed with (null otherwise; ``advantage`` is then the first token's)
    pa.field("token_advantages", pa.list_(pa.float32()))).append(pa.field("returns", pa.list_(pa.float32()))).append(
    pa.field("values", pa.list_(pa.float32())))

# Kept prompt groups beyond a step's target, carried over to the next step's batch (dynamic
# sampling): the scored samples and the step that generated them (``policy_version`` is the
# policy of that step, whose log-probs they hold).
CARRY = SCORED.append(pa.field("step", pa.int64(), nullable=False))


class SchemaError(ValueError):
    """A dataset does not match its schema; the message names the file and the field."""


def check_schema(table: pa.Table, schema: pa.Schema, where: str, extra: bool = False) -> pa.Table:
    """The columns of ``schema`` (extra columns are dropped, or kept after them as they are with
    ``extra``), cast to its types. A schema whose metadata names ``one_of`` columns (nullable)
    needs at least one of them in the table."""
    one_of = (schema.metadata or {}).get(b"one_of", b"").decode().split(",")
    if one_of != [""] and not any(name in table.column_names for name in one_of):
        first, others = one_of[0], " or ".join(f"'{n}' ({schema.field(n).type})" for n in one_of[1:])
        raise SchemaError(f"{where}: missing field '{first}' ({schema.field(first).type}; or {others})")
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
            if _is_text(field.type) and not _is_text(column.type) and column.null_count < len(column):
                # refused, not cast: an integer answer 031 is 31 by then, and a float "0.1" may come back "0.1000000001"
                raise SchemaError(f"{where}: field '{field.name}' has type {column.type}, expected {field.type}: "
                                  "write it as text (a number converted to text loses its formatting, e.g. leading zeros)")
            try:
                table = table.set_column(table.schema.get_field_index(field.name), field.name, column.cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SchemaError(f"{where}: field '{field.name}' has type {column.type}, expected {field.type}") from e
    checked = table.select(schema.names).cast(schema)
    for name in (n for n in table.column_names if extra and n not in schema.names):
        checked = checked.append_column(table.schema.field(name), table.column(name))
    return checked


def check_text(table: pa.Table, where: str) -> None:
    """Every text value of ``table`` (its string columns, and strings inside lists and structs: a
    chat's ``messages``) is UTF-8, else a ``SchemaError`` naming ``where`` (the file), the field, the
    row's prompt_id (or its row) and the bytes that are not. Parquet does not check what a writer
    stored as a string; unchecked, the first read of such a row fails with a bare UnicodeDecodeError."""
    for field in table.schema:
        if not _holds_text(field.type):
            continue
        column = table.column(field.name)
        try:
            column.validate(full=True)  # checks the UTF-8 of every string (no Python objects made)
            continue
        except pa.ArrowInvalid:
            pass
        for row in range(len(column)):  # the first row that does not decode (this is the error path only)
            try:
                column[row].as_py()
            except UnicodeDecodeError as e:
                which = (f"prompt_id {table.column('prompt_id')[row].as_py()}" if "prompt_id" in table.column_names
                         else f"row {row}")
                raise SchemaError(f"{where}: field '{field.name}' is not UTF-8 text ({which}): {e.reason} at byte {e.start} "
                                  f"of {e.object[max(0, e.start - 12): e.end + 12]!r}: write the text as UTF-8") from None
        raise SchemaError(f"{where}: field '{field.name}' is not valid text ({field.type})")


def _holds_text(t: pa.DataType) -> bool:
    if _is_text(t):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _holds_text(t.value_type)
    if pa.types.is_struct(t):
        return any(_holds_text(t.field(i).type) for i in range(t.num_fields))
    return False


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


# Target size of a Parquet row group, in decoded Arrow bytes. A row group is the unit a
# ``PromptReader`` reads and keeps (the last one read), so this bounds an engine host's memory
# for prompts with images. pyarrow's decoding of a group of large binary values peaks at 4-7x
# the group's size (measured with pyarrow 26, 20 KB images: a 4.9 MB group +36 MB of peak RSS,
# 19 MB +112 MB, 30 MB +156 MB, 78 MB +294 MB), so 32 MiB keeps a read's peak near 150 MB while
# each object-store read stays large enough to be efficient. Text-only tables stay one row group
# up to 1Mi rows, as before.
ROW_GROUP_BYTES = 32 << 20
MAX_ROW_GROUP_ROWS = 1 << 20


def rows_per_group(table: pa.Table) -> int:
    """As many rows as fit in ``ROW_GROUP_BYTES`` at the table's average row size (at least 1).

    An average, so a group of rows with larger-than-average images can exceed the target; pass
    ``row_group_rows`` to ``write_table`` where rows vary a lot in size."""
    if not table.num_rows or not table.nbytes:
        return MAX_ROW_GROUP_ROWS
    return max(1, min(MAX_ROW_GROUP_ROWS, ROW_GROUP_BYTES * table.num_rows // table.nbytes))


def write_table(uri: str, table: pa.Table, schema: pa.Schema, row_group_rows: int | None = None) -> pa.Table:
    """Validate against ``schema`` and write one Parquet object atomically; the table as written
    (the schema's types: what ``read_table`` returns of it).

    Row groups hold ``row_group_rows`` rows each (default: ``rows_per_group``, about
    ``ROW_GROUP_BYTES`` of data): a ``PromptReader``'s memory is bounded by the row-group size."""
    table = check_schema(table, schema, uri)
    if row_group_rows is not None and row_group_rows < 1:
        raise ValueError(f"{uri}: row_group_rows must be at least 1, got {row_group_rows}")
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", row_group_size=row_group_rows or rows_per_group(table))
    objectstore.write_bytes(uri, buf.getvalue())
    return table


def write_rows(uri: str, rows: list[dict], schema: pa.Schema) -> pa.Table:
    """``rows`` (dicts with the schema's fields) as one Parquet object, atomically; the table written."""
    return write_table(uri, pa.Table.from_pylist(rows, schema=schema), schema)


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
        checked = check_schema(table, schema, part)
        check_text(checked, part)
        tables.append(checked)
    return pa.concat_tables(tables)


class PromptReader:
    """Random access by global row to a Parquet dataset (one file, or every ``.parquet`` part
    of a folder in name order, as ``read_table`` concatenates them), reading only the row
    groups that hold the rows asked for.

    An engine host never holds a whole prompts dataset (prompts with images do not fit in every
    host): construction reads each part's footer only (row counts and row-group boundaries; a
    part whose columns cannot match ``schema`` fails here, naming the part and field), and
    ``rows`` reads row groups on demand. Memory is bounded by the row-group size, not the
    dataset's (see ``ROW_GROUP_BYTES``; about 150 MB at peak for the default): the last row group
    read is kept, so that consecutive waves falling in the same group do not read it again, and is
    dropped before another is read.

    Global row ``i`` is row ``i`` of ``read_table(uri, schema)``; rows are checked and cast with
    ``check_schema`` as ``read_table`` does (nulls for missing nullable columns; a ``SchemaError``
    naming the part, row group and field for null or uncastable values)."""

    def __init__(self, uri: str, schema: pa.Schema = PROMPTS, extra: bool = False):
        self.uri = uri
        self.schema = schema
        self.extra = extra  # the rows keep the columns the schema does not name (an environment reads them)
        self.parts = objectstore.list_files(uri, suffix=".parquet")
        if not self.parts:
            raise SchemaError(f"{uri}: no .parquet files")
        # One entry per row group of every part, in global order: its first global row and
        # where it lives. Empty groups share their start with the next and are never located.
        self._starts: list[int] = []
        self._groups: list[tuple[int, int]] = []  # (part index, row group index in the part)
        rows = 0
        for p, part in enumerate(self.parts):
            with self._open(part) as f:
                file = self._parquet(f, part)
                check_schema(file.schema_arrow.empty_table(), schema, part)  # columns and types, no data
                for g in range(file.metadata.num_row_groups):
                    self._starts.append(rows)
                    self._groups.append((p, g))
                    rows += file.metadata.row_group(g).num_rows
        self._len = rows
        self._cached: tuple[int, pa.Table] | None = None  # (flat group index, its checked rows)

    def __len__(self) -> int:
        return self._len

    def rows(self, indices: list[int]) -> list[dict]:
        """The rows at global ``indices``, in the order asked (repeats allowed).

        Raises ``IndexError`` for an index outside ``0 <= i < len(self)`` (negative indices
        are errors, not counted from the end)."""
        located = [self._locate(i) for i in indices]
        wanted: dict[int, list[int]] = {}  # flat group -> positions in the answer
        for k, (group, _) in enumerate(located):
            wanted.setdefault(group, []).append(k)
        out: list = [None] * len(indices)
        for group in sorted(wanted):  # file order: one pass over each part
            picked = self._group(group).take([located[k][1] for k in wanted[group]]).to_pylist()
            for k, row in zip(wanted[group], picked):
                out[k] = row
        return out

    def iter_batches(self, batch_rows: int) -> Iterator[list[dict]]:
        """Every row in order, as lists of ``batch_rows`` consecutive rows (the last may be
        shorter), holding one row group and one batch at a time: for validation passes that
        must see every row."""
        if batch_rows < 1:
            raise ValueError(f"{self.uri}: batch_rows must be at least 1, got {batch_rows}")
        batch: list[dict] = []
        for group in range(len(self._groups)):
            table = self._group(group)
            offset = 0
            while offset < table.num_rows:
                take = min(batch_rows - len(batch), table.num_rows - offset)
                batch += table.slice(offset, take).to_pylist()
                offset += take
                if len(batch) == batch_rows:
                    yield batch
                    batch = []
        if batch:
            yield batch

    def _locate(self, index: int) -> tuple[int, int]:
        """(flat row group, row within it) of global row ``index``."""
        index = operator.index(index)
        if not 0 <= index < self._len:
            raise IndexError(f"{self.uri}: row {index} out of range (the dataset has {self._len} rows)")
        group = bisect.bisect_right(self._starts, index) - 1
        return group, index - self._starts[group]

    def _group(self, group: int) -> pa.Table:
        """Flat row group ``group``, read, checked and cast (or the one kept from last time)."""
        if self._cached is not None and self._cached[0] == group:
            return self._cached[1]
        self._cached = None  # drop the old group before reading the next: one in memory, not two
        # ... and hand what reading it freed back to the OS. Arrow's allocator (mimalloc) keeps
        # freed pages for reuse, per thread: reading group after group of images grew RSS with the
        # number of groups read (+8 to +30 MB over 20 waves), until the release here and decoding
        # on this thread only (use_threads=False: its pages are the ones released) made it flat.
        pa.default_memory_pool().release_unused()
        p, g = self._groups[group]
        part = self.parts[p]

        def read() -> pa.Table:
            with self._open(part) as f:
                file = self._parquet(f, part)
                present = set(file.schema_arrow.names)  # read only the schema's columns the file has
                columns = None if self.extra else [n for n in self.schema.names if n in present]
                try:
                    return file.read_row_group(g, columns=columns, use_threads=False)
                except pa.ArrowInvalid as e:
                    raise SchemaError(f"{part} (row group {g}): not readable ({e})") from e

        table = check_schema(objectstore.retrying(part, "read", read), self.schema, f"{part} (row group {g})", self.extra)
        check_text(table, f"{part} (row group {g})")
        self._cached = (group, table)
        return table

    @staticmethod
    def _open(part: str):
        fs, path = objectstore.fs_for(part)
        try:
            # A local part through Arrow's own file: through a Python file object, Arrow's I/O thread
            # drops the last reference to a read's buffer, which needs the GIL, and a process that
            # exits right after a read (a command refusing its input) was now and then aborted in its
            # exit ("terminate called without an active exception"). No read-ahead on remote files: s3fs
            # would otherwise fetch a 50 MB block past every read; pyarrow asks for exactly the byte
            # ranges of the footer and the row group.
            return pa.OSFile(path, "rb") if objectstore.is_local(part) else fs.open(path, "rb", cache_type="none")
        except FileNotFoundError as e:
            raise objectstore.StorageError(f"{part}: not found") from e

    @staticmethod
    def _parquet(f, part: str) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(f)
        except pa.ArrowInvalid as e:
            raise SchemaError(f"{part}: not a readable Parquet file ({e})") from e


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
