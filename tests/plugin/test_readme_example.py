"""The README's "Test your trainer in 10 lines" example, run as a user would: pytest in a subprocess."""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- test-your-trainer:start -->\s*```python\n(.*?)```\s*<!-- test-your-trainer:end -->", text, re.S)
    assert block, "README lost its test-your-trainer example"
    return block.group(1)


def _plugin_args() -> list[str]:
    installed = any(ep.value == "parity.testing.pytest_plugin" for ep in metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "parity.testing.pytest_plugin"]


@pytest.fixture
def user_project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return pytester


def test_readme_example_passes_in_a_fresh_project(user_project: pytest.Pytester) -> None:
    # The README's passing test, plus the same function under top_p: parity must fail it, by name.
    under_top_p = (
        "\n\ndef test_under_top_p(trainer_parity):\n"
        "    trainer_parity(my_logprobs, spec=SamplingSpec(temperature=0.7, top_p=0.9))\n"
    )
    user_project.makepyfile(test_my_trainer=readme_example() + under_top_p)
    result = user_project.runpytest_subprocess(*_plugin_args(), "-p", "no:cacheprovider", timeout=600)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*trainer parity failed*", "*full-vocabulary distribution*"])
