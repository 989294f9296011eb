"""The records file format: round trips, and every kind of bad input refused by name (file, row, column)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from parity.records.read import open_records
from parity.records.schema import COLUMNS, METADATA_KEY, RecordsError
from parity.records.validate import validate_batch
from parity.records.write import records_table, write_records

ROOT = Path(__file__).resolve().parents[2]


def good_row(**over):
    row = dict(
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5],
        temperature=0.7,
        top_k=0,
        top_p=0.9,
        min_p=0.0,
        sampler_logprobs=[-0.1, -0.2, -0.3],
        kept_ids=[3, 9, 4, 5, 7],
        kept_offsets=[0, 2, 3, 5],
        kept_logprobs=[-0.1, -2.3, 0.0, -0.3, -1.4],
        kept_incomplete=[False, False, True],
        trainer_full_logprobs=[-0.2, -0.3, -0.4],
    )
    row.update(over)
    return row


def table_with(**over) -> pa.Table:
    return records_table([good_row(), good_row(**over)])


def refused(table_or_rows, match: str, tmp_path: Path) -> str:
    """Written through pyarrow directly (not our writer, which refuses too), then read back."""
    table = table_or_rows if isinstance(table_or_rows, pa.Table) else records_table(table_or_rows)
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(RecordsError, match=match) as info:
        for _ in open_records(path).batches():
            pass
    msg = str(info.value)
    assert str(path) in msg, msg
    return msg


# -- round trips ---------------------------------------------------------------------------------------


def test_written_rows_read_back_unchanged(tmp_path: Path) -> None:
    path = write_records(tmp_path / "r.parquet", [good_row(), good_row(kept_ids=None, kept_offsets=None, kept_logprobs=None,
                                                                       kept_incomplete=None, top_p=1.0)],
                         metadata={"model": "m", "step": 3})
    rf = open_records(path)
    assert rf.metadata == {"model": "m", "step": 3}
    (b,) = list(rf.batches())
    assert b.n_rows == 2 and b.tokens == 6
    assert b.completion.values.tolist() == [3, 4, 5, 3, 4, 5]
    assert b.kept.valid.tolist() == [True, False]
    # Token -> kept entries (CSR): position 2 of row 0 keeps ids 5, 7; row 1 keeps nothing recorded.
    assert b.kept_token_offsets.tolist() == [0, 2, 3, 5, 5, 5, 5]
    assert b.kept_incomplete.tolist() == [False, False, True, False, False, False]
    assert b.trainer["trainer_full_logprobs"].valid.tolist() == [True, True]
    assert [s.top_p for s in b.specs] == [0.9, 1.0]


def test_other_tools_read_the_file(tmp_path: Path) -> None:
    path = write_records(tmp_path / "r.parquet", [good_row()])
    pandas = pytest.importorskip("pandas")
    df = pandas.read_parquet(path)
    assert list(df["completion_ids"][0]) == [3, 4, 5] and int(df["schema_version"][0]) == 1


@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=6,
    )
)
def test_csr_offsets_map_every_position_to_its_ids(shape) -> None:
    """Random lengths and kept-set sizes: kept_token_offsets slices each position's own ids."""
    rows, expect = [], []
    next_id = 0
    for length, k, has_kept in shape:
        ids_per_pos = [[next_id + j * 10 + i for i in range(k)] for j in range(length)]
        next_id += 1000
        row = dict(prompt_ids=[1], completion_ids=list(range(length)), temperature=1.0, top_k=0, top_p=0.9, min_p=0.0,
                   sampler_logprobs=[-1.0] * length)
        if has_kept:
            flat = [i for p in ids_per_pos for i in p]
            row.update(kept_ids=flat, kept_offsets=list(np.cumsum([0] + [len(p) for p in ids_per_pos])),
                       kept_logprobs=[-1.0] * len(flat))
            expect += ids_per_pos
        else:
            expect += [[] for _ in range(length)]
        rows.append(row)
    b = validate_batch(records_table(rows))
    if b.kept is None:
        assert all(not e for e in expect)
        return
    got = [b.kept.values[b.kept_token_offsets[t] : b.kept_token_offsets[t + 1]].tolist() for t in range(b.tokens)]
    assert got == expect


def describe_columns() -> str:
    """The columns as a Markdown table, as README documents the format."""
    def name(t: pa.DataType) -> str:
        if pa.types.is_list(t):
            return f"list<{name(t.value_type)}>"
        return {"float": "float32", "double": "float64"}.get(str(t), str(t))

    lines = ["| column | type | required | per | meaning |", "|---|---|---|---|---|"]
    for c in COLUMNS:
        lines.append(f"| `{c.name}` | `{name(c.type)}` | {'yes' if c.required else 'no'} | {c.per} | {c.doc} |")
    return "\n".join(lines)


def test_readme_documents_every_column() -> None:
    readme = (ROOT / "docs" / "records_format.md").read_text()
    assert describe_columns() in readme, (
        "docs/records_format.md's records table is out of date: paste describe_columns() of tests/unit/test_records_format.py")
    for c in COLUMNS:
        assert f"`{c.name}`" in readme


# -- bad input -------------------------------------------------------------------------------------------


def test_missing_column_is_named(tmp_path: Path) -> None:
    t = records_table([good_row()]).drop_columns(["sampler_logprobs"])
    path = tmp_path / "m.parquet"
    pq.write_table(t, path)
    with pytest.raises(RecordsError, match=r"missing required column\(s\) sampler_logprobs") as info:
        open_records(path)
    assert str(path) in str(info.value)
    with pytest.raises(RecordsError, match="kept_offsets, kept_logprobs together"):
        validate_batch(records_table([good_row()]).drop_columns(["kept_offsets"]))


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"sampler_logprobs": [-0.1, -0.2]}, r"row 1 column sampler_logprobs: 2 values for 3 completion_ids"),
        ({"trainer_full_logprobs": [-0.2]}, r"row 1 column trainer_full_logprobs: 1 values for 3 completion_ids"),
        ({"kept_incomplete": [False]}, r"row 1 column kept_incomplete: 1 values for 3"),
        ({"kept_logprobs": [-0.1, -2.3, 0.0, -0.3]}, r"row 1 column kept_logprobs: 4 values for 5 kept_ids"),
        ({"kept_offsets": [0, 2, 5]}, r"row 1 column kept_offsets: 3 offsets for 3 completion_ids: allowed L \+ 1 = 4"),
        ({"kept_offsets": [1, 2, 3, 5]}, r"row 1 column kept_offsets: first offset 1: allowed 0"),
        ({"kept_offsets": [0, 2, 3, 4]}, r"row 1 column kept_offsets: last offset 4 for 5 kept_ids"),
        ({"kept_offsets": [0, 3, 2, 5]}, r"row 1 column kept_offsets position 1: offsets decrease"),
    ],
    ids=["sampler", "trainer", "incomplete", "kept-logprobs", "offsets-count", "offsets-start", "offsets-end", "offsets-order"],
)
def test_lengths_that_disagree_are_refused(over, match, tmp_path: Path) -> None:
    refused(table_with(**over), match, tmp_path)


@pytest.mark.parametrize(
    ("column", "value"),
    [("sampler_logprobs", [-0.1, float("nan"), -0.3]), ("trainer_full_logprobs", [-0.1, -0.2, float("nan")]),
     ("kept_logprobs", [-0.1, -2.3, float("nan"), -0.3, -1.4])],
)
def test_nan_is_refused_with_row_and_position(column, value, tmp_path: Path) -> None:
    pos = value.index(next(v for v in value if v != v))
    msg = refused(table_with(**{column: value}), rf"row 1 column {column} position {pos}: value is NaN", tmp_path)
    assert "allowed a finite number or -inf" in msg


def test_plus_infinity_is_refused(tmp_path: Path) -> None:
    refused(table_with(sampler_logprobs=[-0.1, float("inf"), -0.3]), r"position 1: value is inf", tmp_path)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"top_p": 1.5}, r"row 1: SamplingSpec.top_p=1.5 is invalid: allowed a number in \(0, 1\]"),
        ({"top_p": 0.0}, r"SamplingSpec.top_p=0.0 is invalid"),
        ({"temperature": 2.5}, r"SamplingSpec.temperature=2.5 is invalid"),
        ({"temperature": float("nan")}, r"SamplingSpec.temperature=nan is invalid"),
        ({"top_k": -3}, r"SamplingSpec.top_k=-3 is invalid"),
        ({"min_p": -0.1}, r"SamplingSpec.min_p=-0.1 is invalid"),
    ],
)
def test_spec_out_of_range_is_refused(over, match, tmp_path: Path) -> None:
    refused(table_with(**over), match, tmp_path)


def test_negative_ids_and_nulls_are_refused(tmp_path: Path) -> None:
    refused(table_with(completion_ids=[3, -4, 5]), r"row 1 column completion_ids position 1: token id -4 is negative", tmp_path)
    refused(table_with(kept_ids=[3, 9, -4, 5, 7]), r"row 1 column kept_ids entry 2: id -4 is negative", tmp_path)
    t = table_with()
    i = t.schema.get_field_index("temperature")
    t = t.set_column(i, pa.field("temperature", pa.float64()), pa.array([0.7, None]))
    refused(t, r"row 1 column temperature: value is null", tmp_path)
    t = table_with()
    i = t.schema.get_field_index("sampler_logprobs")
    t = t.set_column(i, pa.field("sampler_logprobs", pa.list_(pa.float32())), pa.array([[-0.1, -0.2, -0.3], [-0.1, None, -0.3]], pa.list_(pa.float32())))
    refused(t, r"row 1 column sampler_logprobs position 1: a null inside the list", tmp_path)


def test_wrong_types_are_refused(tmp_path: Path) -> None:
    t = table_with()
    i = t.schema.get_field_index("completion_ids")
    t = t.set_column(i, pa.field("completion_ids", pa.string()), pa.array(["3 4 5", "3 4 5"]))
    refused(t, r"column completion_ids: type string cannot be read as list<item: int32>", tmp_path)
    t = table_with()
    i = t.schema.get_field_index("completion_ids")
    t = t.set_column(i, pa.field("completion_ids", pa.list_(pa.int64())), pa.array([[3, 4, 5], [3, 4, 2**40]]))
    msg = refused(t, r"column completion_ids: type list<.*int64> cannot be read as list<.*int32>", tmp_path)
    assert "not in range" in msg


def test_other_integer_and_float_widths_are_read(tmp_path: Path) -> None:
    """What pandas or Spark write (int64 ids, float64 log-probs) is cast, not refused."""
    t = table_with()
    for name, typ in (("completion_ids", pa.list_(pa.int64())), ("sampler_logprobs", pa.list_(pa.float64()))):
        i = t.schema.get_field_index(name)
        t = t.set_column(i, pa.field(name, typ), t.column(name).cast(typ))
    path = tmp_path / "w.parquet"
    pq.write_table(t, path)
    (b,) = list(open_records(path).batches())
    assert b.completion.values.tolist() == [3, 4, 5, 3, 4, 5]


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    t = table_with()
    i = t.schema.get_field_index("schema_version")
    t = t.set_column(i, pa.field("schema_version", pa.int32(), nullable=False), pa.array([1, 2], pa.int32()))
    msg = refused(t, r"row 1 column schema_version: schema_version 2 is not supported: this parity reads schema_version 1", tmp_path)
    assert "newer parity" in msg
    # The file-level metadata is checked before any row is read.
    good = records_table([good_row()])
    blob = json.dumps({"schema_version": 7, "metadata": {}}).encode()
    path = tmp_path / "v7.parquet"
    pq.write_table(good.replace_schema_metadata({METADATA_KEY: blob}), path)
    with pytest.raises(RecordsError, match=r"schema_version 7 \(file metadata\) is not supported"):
        open_records(path)


def _multi_group_file(tmp_path: Path) -> Path:
    from parity.records import write as records_write

    rows = [good_row(prompt_index=i) for i in range(40)]
    old = records_write.ROW_GROUP_TOKENS
    records_write.ROW_GROUP_TOKENS = 30  # ten sequences (30 tokens) per row group
    try:
        path = write_records(tmp_path / "many.parquet", rows)
    finally:
        records_write.ROW_GROUP_TOKENS = old
    assert pq.ParquetFile(path).metadata.num_row_groups == 4
    return path


def test_truncated_file_is_refused_with_the_file_named(tmp_path: Path) -> None:
    path = _multi_group_file(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(RecordsError, match=r"cut.parquet: not a readable Parquet file, refused before row 0"):
        open_records(cut)


def test_corrupt_row_group_is_refused_with_its_rows_named(tmp_path: Path) -> None:
    path = _multi_group_file(tmp_path)
    md = pq.ParquetFile(path).metadata
    col = md.row_group(2).column(COLUMNS.index(next(c for c in COLUMNS if c.name == "completion_ids")))
    start = col.data_page_offset
    data = bytearray(path.read_bytes())
    # Flip bytes inside the page data of row group 2 (past the page header): the page checksum catches it.
    for i in range(start + col.total_compressed_size - 8, start + col.total_compressed_size - 2):
        data[i] ^= 0xFF
    bad = tmp_path / "flipped.parquet"
    bad.write_bytes(bytes(data))
    rf = open_records(bad)
    rows_seen = 0
    with pytest.raises(RecordsError) as info:
        for b in rf.batches():
            rows_seen += b.n_rows
    msg = str(info.value)
    assert re.search(r"flipped.parquet: rows 20..29 \(row group 2\) cannot be read, the file is truncated or corrupt", msg), msg
    assert rows_seen == 20  # the two sound row groups before it were read


def test_writer_refuses_bad_rows_before_writing(tmp_path: Path) -> None:
    with pytest.raises(RecordsError, match="sampler_logprobs: 1 values for 3"):
        write_records(tmp_path / "w.parquet", [good_row(sampler_logprobs=[-1.0])])
    with pytest.raises(RecordsError, match=r"unknown column\(s\) \['sampler_logprob'\]"):
        records_table([{**good_row(), "sampler_logprob": [0.0]}])


def test_kept_extras_need_a_kept_set(tmp_path: Path) -> None:
    row = good_row(kept_ids=None, kept_offsets=None, kept_logprobs=None)
    with pytest.raises(RecordsError, match="column kept_incomplete is set but there is no kept set"):
        validate_batch(records_table([row]))
    with pytest.raises(RecordsError, match="row 1 column kept_incomplete: set on a row without kept_ids"):
        validate_batch(records_table([good_row(), row]))
    logits = [1.0, -1.0, 0.5, 2.0, 0.0]  # one per kept id of good_row
    stray = good_row(kept_ids=None, kept_offsets=None, kept_logprobs=None, kept_incomplete=None,
                     trainer_kept_logits=[0.0] * 5)
    with pytest.raises(RecordsError, match="row 1 column trainer_kept_logits: set on a row without kept_ids: "
                                           "allowed only with a kept set"):
        validate_batch(records_table([good_row(trainer_kept_logits=logits), stray]))
    row = good_row(kept_offsets=None)
    with pytest.raises(RecordsError, match="present without .*kept_offsets: a kept set needs"):
        validate_batch(records_table([row]))
    with pytest.raises(RecordsError, match="row 1: kept_ids is set but kept_offsets is null"):
        validate_batch(records_table([good_row(), row]))


def test_directory_of_shards(tmp_path: Path) -> None:
    from parity.records.read import records_paths

    for i in (2, 0, 1):
        write_records(tmp_path / "shards" / f"part-{i}.parquet", [good_row()])
    assert [p.name for p in records_paths(tmp_path / "shards")] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no"):
        records_paths(tmp_path / "empty")


def test_read_ahead_keeps_order_raises_the_producers_error_and_stops_when_closed() -> None:
    import threading
    import time

    from parity.records.read import read_ahead

    assert list(read_ahead(iter(range(50)))) == list(range(50))

    def failing():
        yield 1
        raise RecordsError("row 7: bad")

    it = read_ahead(failing())
    assert next(it) == 1
    with pytest.raises(RecordsError, match="row 7: bad"):
        next(it)

    made = []

    def endless():
        while True:
            made.append(len(made))
            yield made[-1]

    it = read_ahead(endless(), depth=1, poll_s=0.01)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    it.close()  # the consumer leaves early: the producer stops, at most a few items ahead
    time.sleep(0.05)
    assert not any(t.name == "parity-read-ahead" and t.is_alive() for t in threading.enumerate())
    assert len(made) <= 3 + 2
