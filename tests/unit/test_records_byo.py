"""Records a user writes with pyarrow from README alone: what ``parity analyze`` reads, refuses, warns
about and renders when a file has only some inputs, other metadata layouts, no page checksums, no rows,
big row groups, another sampler, or columns of other widths."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from parity.analyze import analyze
from parity.cli.main import main
from parity.records.read import MAX_BATCH_ROWS, check_batch_rows, open_records, page_checksums
from parity.records.schema import METADATA_KEY, RecordsError
from parity.records.write import write_records

ROOT = Path(__file__).resolve().parents[2]


def user_rows(n: int = 3, *, kept: bool = True, naive: float = -0.1, length: int = 4) -> list[dict]:
    """A naive trainer's dump at top_p = 0.9: its log-probs sit log S = ``naive`` below the sampler's."""
    rows = []
    for i in range(n):
        lp = [-0.5 - 0.25 * t for t in range(length)]
        row = dict(schema_version=1, prompt_ids=[1, 2], completion_ids=[3 + t for t in range(length)], temperature=1.0,
                   top_k=0, top_p=0.9, min_p=0.0, sampler_logprobs=lp, prompt_index=i,
                   trainer_logprobs=[v + naive for v in lp])
        if kept:
            # Each position keeps its sampled token and one other, whose probabilities sum to 1.
            row["kept_ids"] = [x for t in range(length) for x in (3 + t, 40 + t)]
            row["kept_offsets"] = list(range(0, 2 * length + 1, 2))
            row["kept_logprobs"] = [x for v in lp for x in (v, float(np.log1p(-np.exp(v))))]
        rows.append(row)
    return rows


SCHEMA = {
    "schema_version": pa.int32(), "prompt_ids": pa.list_(pa.int32()), "completion_ids": pa.list_(pa.int32()),
    "temperature": pa.float64(), "top_k": pa.int64(), "top_p": pa.float64(), "min_p": pa.float64(),
    "sampler_logprobs": pa.list_(pa.float32()), "prompt_index": pa.int64(), "trainer_logprobs": pa.list_(pa.float64()),
    "kept_ids": pa.list_(pa.int32()), "kept_offsets": pa.list_(pa.int64()), "kept_logprobs": pa.list_(pa.float32()),
}


def pyarrow_file(path: Path, rows: list[dict], meta: object = None, *, typed: bool = True, **write: object) -> Path:
    """Written with pyarrow as a user would (pyarrow's defaults unless ``write`` says otherwise)."""
    if typed:
        schema = pa.schema([(k, SCHEMA[k]) for k in rows[0]]) if rows else pa.schema(list(SCHEMA.items()))
        table = pa.Table.from_pylist(rows, schema=schema)
    else:
        table = pa.Table.from_pylist(rows)
    if meta is not None:
        table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})
    pq.write_table(table, path, **write)
    return path


def cli(path: Path, out: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["analyze", str(path), "--out", str(out), "--no-plots", *extra])
    got = capsys.readouterr()
    return code, got.out, got.err


# -- 1. analyses without --model and without recompute columns render, and say what was not evaluated --


@pytest.mark.parametrize("kept", [True, False], ids=["kept-set-and-trainer-log-probs", "log-probs-only"])
def test_a_partial_analysis_writes_both_reports_and_names_what_it_did_not_evaluate(kept, tmp_path: Path, capsys) -> None:
    path = pyarrow_file(tmp_path / "r.parquet", user_rows(kept=kept), write_page_checksum=True)
    code, out, err = cli(path, tmp_path / "out", capsys=capsys)
    assert code in (0, 1), err
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    md = (tmp_path / "out" / "report.md").read_text() + (tmp_path / "out" / "details.md").read_text()
    # Gates without inputs are listed, never passed: report-wide and per scenario, with the reason.
    assert data["complete"] is False
    listed = {g["gate"]: g for g in data["not_evaluated"]}
    for gate in ("trainer_under_test_drift", "trainer_under_test_mean_bias", "recompute_drift"):
        assert "trainer_bound" in listed[gate]["reason"] and listed[gate]["scenarios"] == ["T=1 top_p=0.9"]
    assert "## Gates not evaluated" in md and "trainer_under_test_drift: no trainer_bound" in md
    assert "n/a" in md and "not gated" in md  # the naive trainer's gap is measured, and said to be ungated
    if data["passed"]:
        assert code == 0 and "**PASS on the gates evaluated**" in md
        assert re.search(r"1/1 scenarios pass on the gates evaluated \(\d+ not evaluated\)", out)
    else:
        assert code == 1 and "**FAIL**" in md
    assert "NOT EVALUATED" in out


# -- 2. the metadata layouts README documents ------------------------------------------------------------

FACTS = {"sampler": "my-engine", "sampler_version": "1.2", "dtype": "bfloat16", "torch": "2.9.0", "vocab_size": 64}


@pytest.mark.parametrize("meta", [{"schema_version": 1, **FACTS}, {"schema_version": 1, "metadata": FACTS}],
                         ids=["flat", "nested"])
def test_both_metadata_layouts_are_read(meta, tmp_path: Path) -> None:
    path = pyarrow_file(tmp_path / "m.parquet", user_rows(), meta)
    assert open_records(path).metadata == FACTS
    report = analyze(path, out=tmp_path / "out", plots=False)
    env = report["environment"]
    assert (env["sampler"], env["sampler_version"], env["dtype"], env["torch"]) == ("my-engine", "1.2", "bfloat16", "2.9.0")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "Records from: my-engine 1.2, torch 2.9.0" in md and "dtype bfloat16" in md


@pytest.mark.parametrize("meta, match", [
    ([1, 2], r"'parity.records' is a JSON list: allowed a JSON object"),
    ({"model": "x"}, r"file metadata 'parity.records' has no schema_version"),
    ({"schema_version": 1, "metadata": [1]}, r"field 'metadata' is a JSON list: allowed an object of facts"),
    ({"schema_version": 1, "dtype": "float32", "metadata": {"dtype": "bfloat16"}}, r"gives dtype twice with different values"),
])
def test_metadata_that_is_neither_layout_is_refused_by_name(meta, match, tmp_path: Path) -> None:
    path = pyarrow_file(tmp_path / "m.parquet", user_rows(), meta)
    with pytest.raises(RecordsError, match=match) as info:
        open_records(path)
    assert str(path) in str(info.value)


# -- 3. page checksums --------------------------------------------------------------------------------------


def test_files_without_page_checksums_are_named_in_the_report(tmp_path: Path, capsys) -> None:
    plain = pyarrow_file(tmp_path / "plain.parquet", user_rows())  # pyarrow's defaults: no checksums
    summed = pyarrow_file(tmp_path / "summed.parquet", user_rows(), write_page_checksum=True)
    ours = write_records(tmp_path / "ours.parquet", user_rows())
    assert page_checksums(plain, pq.ParquetFile(plain).metadata) is False
    assert page_checksums(summed, pq.ParquetFile(summed).metadata) is True
    assert open_records(ours).page_checksums is True
    code, out, _ = cli(plain, tmp_path / "out", capsys=capsys)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["records"]["page_checksums"] == "none" and data["records"]["files_without_page_checksums"] == [str(plain)]
    assert any("carry no page checksums" in w for w in data["warnings"])
    assert "## Warnings" in (tmp_path / "out" / "report.md").read_text()
    assert re.search(r"^WARNING 1 of 1 file\(s\) carry no page checksums", out, re.M)
    report = analyze(summed, out=None)
    assert report["records"]["page_checksums"] == "all" and not any("checksum" in w for w in report["warnings"])


# -- 4. nothing to analyse ---------------------------------------------------------------------------------


def test_a_file_without_rows_is_a_user_error(tmp_path: Path, capsys) -> None:
    empty = pyarrow_file(tmp_path / "empty.parquet", [])
    with pytest.raises(RecordsError, match=f"no rows in {re.escape(str(empty))}"):
        analyze(empty, out=None)
    code, out, err = cli(empty, tmp_path / "out", capsys=capsys)
    assert code == 2 and f"parity analyze: error: no rows in {empty}" in err and "scenarios pass" not in out
    assert not (tmp_path / "out" / "report.json").exists()
    silent = pyarrow_file(tmp_path / "silent.parquet", [{**r, "completion_ids": [], "sampler_logprobs": [],
                                                         "trainer_logprobs": []} for r in user_rows(kept=False)])
    with pytest.raises(RecordsError, match=r"no completion tokens in .*silent.parquet: its 3 row\(s\)"):
        analyze(silent, out=None)


# -- 5. bounded batches ---------------------------------------------------------------------------------


def test_one_big_row_group_is_read_in_bounded_batches(tmp_path: Path) -> None:
    n_rows, length = 4000, 500
    offsets = pa.array(np.arange(0, n_rows * length + 1, length, dtype=np.int32))
    rng = np.random.default_rng(0)
    lp = -rng.random(n_rows * length)
    table = pa.table({
        "schema_version": pa.array(np.ones(n_rows, np.int32)), "prompt_ids": pa.array([[1]] * n_rows, pa.list_(pa.int32())),
        "completion_ids": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 1000, n_rows * length, dtype=np.int32))),
        "temperature": pa.array(np.ones(n_rows)), "top_k": pa.array(np.zeros(n_rows, np.int64)),
        "top_p": pa.array(np.ones(n_rows)), "min_p": pa.array(np.zeros(n_rows)),
        "sampler_logprobs": pa.ListArray.from_arrays(offsets, pa.array(lp.astype(np.float32))),
        "trainer_logprobs": pa.ListArray.from_arrays(offsets, pa.array(lp)),
    })
    path = tmp_path / "big.parquet"
    pq.write_table(table, path, row_group_size=n_rows, compression="none", use_dictionary=False)
    del table
    md = pq.ParquetFile(path).metadata
    chunks = sum(md.row_group(0).column(i).total_compressed_size for i in range(md.num_columns))
    assert md.num_row_groups == 1 and chunks > 30_000_000
    sizes, peak = [], 0
    for b in open_records(path).batches(batch_rows=100):
        sizes.append(b.n_rows)
        peak = max(peak, pa.total_allocated_bytes())
    assert sizes == [100] * 40
    # Read page by page: what pyarrow holds is a batch and a page buffer, not the row group's column chunks.
    assert peak < chunks / 2, (peak, chunks)


def test_batch_rows_is_capped_with_the_flag_named(tmp_path: Path, capsys) -> None:
    assert check_batch_rows(MAX_BATCH_ROWS) == MAX_BATCH_ROWS
    for bad in (0, MAX_BATCH_ROWS + 1, 200_000):
        with pytest.raises(ValueError, match=rf"batch_rows {bad} is out of range: allowed an integer from 1 to 16,384"):
            check_batch_rows(bad)
    path = pyarrow_file(tmp_path / "r.parquet", user_rows())
    code, _, err = cli(path, tmp_path / "out", "--batch-rows", "200000", capsys=capsys)
    assert code == 2 and "--batch-rows 200000 is out of range: allowed an integer from 1 to 16,384" in err


# -- 6. the sampler is named, not assumed -------------------------------------------------------------------


def test_the_report_names_the_sampler_from_the_metadata_or_says_sampler(tmp_path: Path) -> None:
    path = pyarrow_file(tmp_path / "s.parquet", user_rows(), {"schema_version": 1, "sampler": "sglang"})
    analyze(path, out=tmp_path / "named", plots=False)
    named = (tmp_path / "named" / "report.md").read_text()
    assert "Records from: sglang," in named and "trainer − sglang" in named
    anonymous = pyarrow_file(tmp_path / "a.parquet", user_rows())
    report = analyze(anonymous, out=tmp_path / "anon", plots=False)
    text = (tmp_path / "anon" / "report.md").read_text()
    assert report["environment"]["sampler"] is None
    assert "vLLM" not in text and "None" not in text and "Records from: sampler (not recorded)" in text
    # parity's own export says vLLM and its version.
    ours = write_records(tmp_path / "o.parquet", user_rows(), metadata={"producer": "parity run", "vllm": "0.32.0"})
    env = analyze(ours, out=None)["environment"]
    assert (env["sampler"], env["sampler_version"]) == ("vLLM", "0.32.0")


# -- 7. unstated defaults said out loud --------------------------------------------------------------------


def test_float64_values_a_float32_column_rounds_are_warned_about(tmp_path: Path) -> None:
    rows = user_rows(kept=False)
    rows[0]["sampler_logprobs"] = [-0.1, -0.5, -0.75, -1.0]  # -0.1 is not a float32
    path = pyarrow_file(tmp_path / "w.parquet", rows, typed=False)  # from_pylist infers int64 and float64
    (b,) = list(open_records(path).batches())
    note = b.casts["sampler_logprobs"]
    assert (note.changed, note.values, note.overflowed) == (1, 12, 0) and 0 < note.max_change < 1e-8
    warnings = analyze(path, out=None)["warnings"]
    assert any(re.search(r"w.parquet column sampler_logprobs: double values read as float changed 1 of 12", w)
               for w in warnings), warnings
    exact = pyarrow_file(tmp_path / "x.parquet", user_rows(kept=False), typed=False)  # quarters: exact in float32
    assert not [w for w in analyze(exact, out=None)["warnings"] if "read as" in w]


def test_kept_sets_without_kept_incomplete_are_said_to_be_taken_as_complete(tmp_path: Path) -> None:
    path = pyarrow_file(tmp_path / "k.parquet", user_rows(), write_page_checksum=True)
    (w,) = analyze(path, out=None)["warnings"]
    assert w.startswith("no kept_incomplete column: every kept set is taken as complete")
    rows = [{**r, "kept_incomplete": [False] * 4} for r in user_rows()]
    path = write_records(tmp_path / "k2.parquet", rows)
    assert analyze(path, out=None)["warnings"] == []


def test_readme_pyarrow_snippet_writes_a_checksummed_file_with_its_facts(tmp_path: Path, monkeypatch) -> None:
    text = (ROOT / "docs" / "records_format.md").read_text()
    block = re.search(r"<!-- pyarrow-records:start -->\s*```python\n(.*?)```\s*<!-- pyarrow-records:end -->", text, re.S)
    assert block, "docs/records_format.md lost its pyarrow records snippet"
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), "docs/records_format.md", "exec"), {})
    rf = open_records(tmp_path / "rollouts.parquet")
    assert rf.page_checksums is True and rf.metadata["sampler"] == "my-engine"
    assert not [w for w in analyze(rf.path, out=None)["warnings"] if "checksum" in w or "read as" in w]
