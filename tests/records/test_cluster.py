"""``parity analyze --engine ray`` on a local cluster: the same report as the local analysis of the
same shards, the planted fault's positions named by its shard and row, a bad shard refused with the
local message.

The shards (tests/records_synth.py, plus per-token bounds so the drift gates judge) differ on purpose:
two specs (two scenarios, one spread over three files), several row groups per file, one file
without ``prompt_index`` (its positions are named by file and row), one with a column the others lack.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import records_synth

from parity.analyze import analyze
from parity.analyze.cluster import ERROR_NOTE, parse_engine, records_error_in
from parity.errors import SetupError, UsageError
from parity.judge.token_columns import Options
from parity.records.schema import RecordsError
from parity.records.write import RecordsWriter

pytestmark = pytest.mark.engines

VOCAB, LENGTH = 256, 6
META = {"vocab_size": VOCAB, "dtype": "float32", "trainer_dtype": "float32"}
# (name, sequences, K kept ids = top_k, prompt_index column, extra column)
SHARDS = [
    ("part-0.parquet", 23, 4, True, False),
    ("part-1.parquet", 17, 4, False, False),
    ("part-2.parquet", 29, 8, True, True),
    ("part-3.parquet", 11, 4, True, False),
]
FAULTY = "part-1.parquet"
# (row, position, shift of trainer_replay_logprobs in nats): the larger one is the worst position; the two
# rows fall in different row groups of the file.
PLANTED = [(16, 4, 0.5), (2, 1, 0.2)]
BATCH_ROWS = 7  # local batches cut across the engines' splits


def _with_values(table: pa.Table, column: str, at: list[tuple[int, int, float]], *, set_to: float | None = None) -> pa.Table:
    """``column`` (a per-token list) with values shifted (or set) at (row, position)."""
    arr = table.column(column).combine_chunks()
    vals = arr.values.to_numpy(zero_copy_only=False).copy()
    for row, pos, shift in at:
        i = row * LENGTH + pos  # every sequence has LENGTH tokens
        vals[i] = set_to if set_to is not None else vals[i] + shift
    new = pa.ListArray.from_arrays(arr.offsets, pa.array(vals, type=arr.type.value_type))
    return table.set_column(table.schema.get_field_index(column), column, new)


def shard_table(n_seq: int, k: int, seed: int, first_prompt: int, *, prompt_index: bool, extra: bool) -> pa.Table:
    rng = np.random.default_rng(seed)
    # parity's own estimators judged (no trainer under test, whose verdict would set replay's gates aside)
    t = records_synth.chunk(n_seq, LENGTH, k, VOCAB, rng, first_prompt=first_prompt).drop_columns(["trainer_logprobs"])
    offsets = pa.array(np.arange(n_seq + 1, dtype=np.int32) * LENGTH)
    for name in ("trainer_bound", "trainer_bound_full"):
        bound = pa.array(1e-6 * (1.0 + rng.random(n_seq * LENGTH)))
        t = t.append_column(name, pa.ListArray.from_arrays(offsets, bound))
    if not prompt_index:
        t = t.drop_columns(["prompt_index"])
    if extra:
        t = t.append_column("step", pa.array(np.full(n_seq, 3, dtype=np.int64)))
    return t


def write_shards(folder: Path, *, fault: bool) -> Path:
    folder.mkdir(parents=True)
    first = 0
    for j, (name, n_seq, k, prompt_index, extra) in enumerate(SHARDS):
        t = shard_table(n_seq, k, 10 + j, first, prompt_index=prompt_index, extra=extra)
        if fault and name == FAULTY:
            t = _with_values(t, "trainer_replay_logprobs", PLANTED)
        with RecordsWriter(folder / name, metadata=META) as w:
            for a in range(0, n_seq, 5):  # a row group per 5 rows
                w.write(t.slice(a, 5))
        first += n_seq
    return folder


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    return {"clean": write_shards(root / "clean", fault=False), "fault": write_shards(root / "fault", fault=True)}


@pytest.fixture(scope="module")
def local_reports(shards):
    return {k: run(v, "local") for k, v in shards.items()}


def run(path: Path, engine: str) -> dict:
    return analyze(path, options=Options(batch_rows=BATCH_ROWS), engine=engine, plots=False)


# Exact: counts, maxima, minima, headroom, positions, verdicts, messages. Sums merged in another order
# (means, the mean-bias limits built from them) agree to float64 rounding; p99 comes from integer
# histogram counts and the exact maximum, within the histogram's bin (0.01 decade, about 1.2 %).
EXACT_WORDS = ("max", "min", "headroom")


def differences(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in the local report" for k in a.keys() - b.keys()]
        out += [f"{path}.{k}: only in the engine's report" for k in b.keys() - a.keys()]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and not (a == b or (math.isnan(a) and math.isnan(b))):
        last = path.rsplit(".", 1)[-1]
        if "p99" in last:
            ok = abs(a - b) <= 0.012 * max(abs(a), abs(b))
        elif any(w in last for w in EXACT_WORDS) or ".violations" in path:
            ok = False
        else:
            ok = abs(a - b) <= 1e-12 * max(1.0, abs(a), abs(b))
        return [] if ok else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def comparable(report: dict) -> dict:
    out = {k: v for k, v in report.items() if k != "timings"}
    out["config"] = {k: v for k, v in report["config"].items() if k != "engine"}
    return out


def check_planted(report: dict, folder: Path) -> None:
    bad = [s for s in report["scenarios"] if s["verdict"] == "fail"]
    assert [s["spec"]["top_k"] for s in bad] == [4], [(s["name"], s["violations"]) for s in bad]
    (v,) = [v for v in bad[0]["violations"] if v["gate"] == "replay_drift"]
    where = [(p["prompt"], p["position"], p["note"]) for p in v["worst"][:2]]
    # No prompt_index in that shard: positions are named by the file and the row in it.
    source = str(folder / FAULTY)
    assert where == [(r, t, f"{source}: prompt = row") for r, t, _ in PLANTED], where
    assert source in v["message"]


@pytest.fixture
def engine(ray_cluster):
    return "ray"


@pytest.mark.parametrize("which", ["clean", "fault"])
def test_engine_report_equals_the_local_analysis(engine, which, shards, local_reports) -> None:
    local = local_reports[which]
    assert local["records"]["files"] == len(SHARDS) and len(local["scenarios"]) == 2
    if which == "clean":
        assert local["passed"], [v["message"] for s in local["scenarios"] for v in s["violations"]]
    else:
        check_planted(local, shards["fault"])
    remote = run(shards[which], engine)
    assert remote["config"]["engine"] == engine
    assert differences(comparable(local), comparable(remote)) == []


def test_a_bad_shard_fails_with_the_local_message(engine, tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "bad", fault=False)
    t = pq.read_table(folder / "part-2.parquet")
    pq.write_table(_with_values(t, "sampler_logprobs", [(9, 2, 0.0)], set_to=float("nan")), folder / "part-2.parquet",
                   row_group_size=5)
    with pytest.raises(RecordsError) as local:
        run(folder, "local")
    want = f"{folder / 'part-2.parquet'} row 9 column sampler_logprobs position 2: value is NaN"
    assert str(local.value).startswith(want), str(local.value)
    with pytest.raises(RecordsError) as remote:
        run(folder, engine)
    assert str(remote.value) == str(local.value)


def test_the_map_step_takes_rows_in_any_order_and_split(shards, local_reports, monkeypatch) -> None:
    """No cluster: what an engine hands the workers (rows of several files, shuffled, in uneven pieces,
    each with its file and row number) gives the local report, the planted positions included."""
    import parity.analyze.cluster as engines

    def shuffled(eng, targets, step, timeout_s, say):
        parts = []
        for path in targets:
            t = pq.read_table(path)
            parts.append(t.append_column("file", pa.array([path] * t.num_rows))
                         .append_column("row", pa.array(np.arange(t.num_rows))))
        every = pa.concat_tables(parts, promote_options="default")
        order = np.random.default_rng(0).permutation(every.num_rows)
        out = []
        for piece in np.array_split(order, 5):
            t = every.take(pa.array(piece))
            s = step.summarize(t.drop_columns(["file", "row"]), t.column("file").to_numpy(zero_copy_only=False),
                               t.column("row").to_numpy())
            out.append(s.to_json())
        return out[::-1]

    monkeypatch.setattr(engines, "_on_ray", shuffled)
    for which in ("clean", "fault"):
        got = run(shards[which], "ray")
        assert differences(comparable(local_reports[which]), comparable(got)) == []


def test_engine_forms_and_the_error_note() -> None:
    assert parse_engine("ray").kind == "ray"
    assert parse_engine("ray://head:10001").address == "ray://head:10001"
    assert parse_engine("local").kind == "local"
    for bad in ("dask", "spark", "spark://m:7077", "spark:local[3]", "ray://"):
        with pytest.raises(UsageError, match=rf"--engine '{re.escape(bad)}' is invalid: allowed local; ray .*; ray://HOST:PORT$"):
            parse_engine(bad)
    # An engine hands a worker's exception back as text: the note carries the message through.
    err = RecordsError("f.parquet row 3 column x: value is NaN: allowed a finite number")
    err.add_note(ERROR_NOTE + '"f.parquet row 3 column x: value is NaN: allowed a finite number"')
    wrapped = RuntimeError("Traceback (most recent call last):\n  ...\nRecordsError: ...\n"
                           + "\n".join(err.__notes__) + "\n(at the worker)")
    assert records_error_in(wrapped) == str(err)
    assert records_error_in(RuntimeError("no note here")) is None


@pytest.mark.parametrize("engine", ["spark", "spark://m:7077"])
def test_the_command_refuses_an_engine_it_does_not_run(engine, shards, tmp_path: Path, capsys) -> None:
    from parity.cli.main import main

    out = tmp_path / "out"
    assert main(["analyze", str(shards["clean"]), "--engine", engine, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--engine {engine!r} is invalid: allowed local; ray" in err and "ray://HOST:PORT" in err, err
    assert not out.exists()


def test_a_missing_engine_names_its_extra(tmp_path: Path, monkeypatch) -> None:
    import parity.analyze.cluster as engines

    real = engines.importlib.import_module

    def hidden(name, *a):
        if name.split(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name, *a)

    monkeypatch.setattr(engines.importlib, "import_module", hidden)
    folder = write_shards(tmp_path / "s", fault=False)
    with pytest.raises(SetupError, match=r"--engine ray needs ray, which is not installed: pip install 'parity\[ray\]'"):
        run(folder, "ray")
