"""The RL catalogue file: the packaged entries load from the installed package, a bad entry is an error
that names the file, the entry, the key and the value, and a file of one's own adds entries."""

from __future__ import annotations

import fnmatch
import math
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from parity.core import rl, rl_catalogue

REPO = Path(__file__).resolve().parents[2]

METHOD = """[[method]]
name = "mine"
frameworks = ["me"]
level = "token"
statistic = "ratio"
interval = [0.5, 2.0]
action = "mask"
source = "here"
"""

METRIC = """[[metric]]
framework = "me"
name = "mine/mean"
level = "token"
statistic = "mean |δ|"
values = "abs_delta"
reduce = "mean"
source = "here"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "catalogue.toml"
    path.write_text(text, encoding="utf-8")
    return path


def deltas() -> rl.Mismatch:
    return rl.Mismatch((torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64),))


def test_the_packaged_catalogue_is_what_the_module_holds() -> None:
    metrics, methods = rl_catalogue.load_catalogue()
    assert [e.describe() for e in metrics] == [e.describe() for e in rl_catalogue.METRICS]
    assert [e.describe() for e in methods] == [e.describe() for e in rl_catalogue.METHODS]
    assert len(metrics) == 20 and len(methods) == 19


def test_the_catalogue_ships_as_package_data() -> None:
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["parity"]
    assert any(fnmatch.fnmatch(f"data/{rl_catalogue.CATALOGUE}", p) for p in patterns)
    assert (REPO / "parity" / "data" / rl_catalogue.CATALOGUE).is_file()


def test_a_file_of_ones_own_adds_a_method_and_a_metric(tmp_path: Path) -> None:
    metrics, methods = rl_catalogue.load_catalogue(write(tmp_path, METRIC + "\n" + METHOD))
    assert [e.name for e in metrics] == ["mine/mean"] and [e.name for e in methods] == ["mine"]
    out = rl_catalogue.summarize(deltas(), metrics=rl_catalogue.METRICS + metrics, methods=rl_catalogue.METHODS + methods)
    assert out["metrics"]["mine/mean"] == pytest.approx(2 / 3)
    # e^1 > 2 and e^-1 < 0.5: two of the three tokens fall outside [0.5, 2] and are masked.
    assert out["methods"]["mine"]["any"]["affected"] == 2


def test_compute_names_a_metric_that_is_no_reduction(tmp_path: Path) -> None:
    text = METRIC.replace('values = "abs_delta"\nreduce = "mean"\n', 'compute = "pearson_probs"\n')
    (metric,), _ = rl_catalogue.load_catalogue(write(tmp_path, text))
    assert metric.needs_probs and metric.value(deltas()) is None  # no sampler log-probs given


Edit = Callable[[str], str]
BAD_METHODS: list[tuple[Edit, str]] = [
    (lambda t: t.replace("[0.5, 2.0]", "[2.0, 0.5]"), "[[method]] 1 ('mine'): Method 'mine': interval=(2.0, 0.5) is invalid"),
    (lambda t: t.replace('"mask"', '"zap"'), "Method 'mine': action='zap' is invalid: allowed none, clip"),
    (lambda t: t.replace('"ratio"', '"seq_ratio"'), "level='token' is invalid: allowed 'sequence'"),
    (lambda t: t.replace("[0.5, 2.0]", '"wide"'), "interval='wide' is invalid: allowed [low, high], two numbers"),
    (lambda t: t.replace("[0.5, 2.0]", '[0.5, "2"]'), "interval=[0.5, '2'] is invalid: allowed [low, high]"),
    (lambda t: t.replace('["me"]', '"me"'), "frameworks='me' is invalid: allowed a non-empty list of strings"),
    (lambda t: t + 'colour = "red"\n', "colour='red' is not a field: allowed name, frameworks"),
    (lambda t: t.replace('source = "here"\n', ""), "source missing: required name, frameworks"),
    (lambda t: t + t, "method name 'mine' is used twice"),
    (lambda t: t.replace("[[method]]", "[[methods]]"), "methods=[{"),
    (lambda t: t.replace("[[method]]", "[method"), "not valid TOML"),
]
BAD_METRICS: list[tuple[Edit, str]] = [
    (lambda t: t.replace('"abs_delta"', '"nope"'), "Metric 'mine/mean': values='nope' is invalid: allowed abs_delta"),
    (lambda t: t.replace('"mean"\n', '"median"\n'), "reduce='median' is invalid: allowed mean, max, min, std"),
    (lambda t: t.replace('"token"', '"sequence"'), "level='sequence' is invalid: allowed 'token'"),
    (lambda t: t + 'compute = "pearson_probs"\n', "compute='pearson_probs' is invalid: allowed compute alone"),
    (lambda t: t + 'threshold = { limit = 0.1, op = ">", source = "s" }\n', "threshold: Threshold.op='>' is invalid"),
    (lambda t: t + 'threshold = { limit = 0.1, op = "<" }\n', "threshold={'limit': 0.1, 'op': '<'} is invalid"),
    (lambda t: t.replace('framework = "me"', "framework = 3"), "framework=3 is invalid: allowed a string"),
]


@pytest.mark.parametrize(("text", "edit", "words"), [(METHOD, e, w) for e, w in BAD_METHODS]
                         + [(METRIC, e, w) for e, w in BAD_METRICS])
def test_a_bad_entry_names_the_file_the_entry_the_key_and_the_value(
    tmp_path: Path, text: str, edit: Edit, words: str
) -> None:
    path = write(tmp_path, edit(text))
    with pytest.raises(ValueError) as err:
        rl_catalogue.load_catalogue(path)
    assert str(err.value).startswith(str(path)) and words in str(err.value), str(err.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.toml"):
        rl_catalogue.load_catalogue(tmp_path / "nowhere.toml")


def test_infinite_bounds_read_as_floats(tmp_path: Path) -> None:
    _, (method,) = rl_catalogue.load_catalogue(write(tmp_path, METHOD.replace("[0.5, 2.0]", "[0, inf]")))
    assert method.interval == (0.0, math.inf) and isinstance(method.interval[0], float)
