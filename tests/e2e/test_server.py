"""Server mode on the real CPU engine: a vLLM OpenAI-compatible server spawned on 127.0.0.1.

Two servers are spawned in this module, one at a time: a short-lived one in raw_logprobs mode (the
fault detection and the kill-mid-run test), then the module's processed-mode server that runs the
default matrix (tie fixture aside: it needs a server of its own), the offline cross-check and the
attach test, and is shut down by the last test, which checks no process is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from parity.core.matrix import Matrix, default_matrix
from parity.core.spec import SamplingSpec
from parity.engines.session import EnginePool, make_prompts
from parity.engines.vllm_server.client import ServerRollout
from parity.engines.vllm_server.process import free_port, process_group_alive
from parity.engines.vllm_server.protocol import (
    LogprobsModeMismatch,
    ServerDied,
    ServerUnreachable,
)
from parity.fixtures import resolve_model
from parity.run import RunConfig, run

pytestmark = pytest.mark.e2e

MODEL = "qwen2-tiny"
STARTUP_S = 300.0  # generous for a loaded 2-core machine; ~40-60 s measured
CROSS_SPECS = (
    SamplingSpec(1.0),
    SamplingSpec(0.0),
    SamplingSpec(0.7, top_k=20, top_p=0.9),
    SamplingSpec(1.0, top_p=0.9),
    SamplingSpec(1.3, min_p=0.1),
    SamplingSpec(1.3, top_k=20, top_p=0.8, min_p=0.1),
)
ADAPTIVE_SPECS = (SamplingSpec(1.0, top_p=0.9), SamplingSpec(0.7, min_p=0.1))


def server_processes(port: int) -> list[int]:
    """Pids of processes whose command line names this port (a leftover server would)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"vllm.entrypoints.openai.api_server" in cmd and str(port).encode() in cmd:
            found.append(int(d.name))
    return found


def assert_gone(rollout: ServerRollout) -> None:
    pid, port = rollout.pid, int(str(rollout.url).rsplit(":", 1)[1])
    assert pid is not None
    assert rollout.proc is not None and rollout.proc.returncode is not None
    assert not process_group_alive(pid), f"process group {pid} still has members"
    assert server_processes(port) == []


def kill_when_running(rollout: ServerRollout, killed: threading.Event, deadline_s: float = 120.0) -> None:
    """SIGKILL the server's process group as soon as its /metrics shows a request running."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            text = opener.open(f"{rollout.url}/metrics", timeout=2).read().decode()
        except OSError:
            text = ""
        running = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        ]
        if any(v > 0 for v in running):
            os.killpg(rollout.pid, signal.SIGKILL)
            killed.set()
            return
        time.sleep(0.02)


def small_matrix() -> Matrix:
    """The default matrix at CI size, without the scenarios on the tie fixture (another model)."""
    m = default_matrix(prompts=4, max_tokens=8)
    return Matrix("default-server", tuple(s for s in m.scenarios if s.model is None))


# -- no server needed ---------------------------------------------------------------------------


def test_closed_port_is_an_error_naming_the_url(capsys, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with pytest.raises(ServerUnreachable, match=f"127.0.0.1:{port}.*connection refused"):
        ServerRollout(resolve_model(MODEL), server=url + "/v1", request_timeout_s=10)
    assert time.perf_counter() - t0 < 30
    from parity.cli.main import main

    assert main(["run", "--server", url, "--no-plots", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error" in err and url in err


# -- a raw_logprobs server: detection, then killed mid-run -----------------------------------------


def test_raw_mode_is_detected_and_a_server_killed_mid_run_is_an_error() -> None:
    model = resolve_model(MODEL)
    # check_mode=False keeps it up past the start-up probe, so the per-record checks see real raw data.
    raw = ServerRollout(
        model, logprobs_mode="raw_logprobs", check_mode=False, startup_timeout_s=STARTUP_S, timeout_s=120
    )
    try:
        with pytest.raises(LogprobsModeMismatch, match="raw_logprobs.*--logprobs-mode processed_logprobs"):
            raw.probe_logprobs_mode()
        # What a user hits: attaching to a server launched with vLLM's default mode fails at start-up.
        with pytest.raises(LogprobsModeMismatch, match=f"probe request.*{raw.url}.*raw_logprobs"):
            ServerRollout(model, server=raw.url, timeout_s=120)
        assert raw.proc is not None and raw.proc.poll() is None, "a refused attach must not stop the server"
        prompts = make_prompts(raw.tokenizer(), 4)
        for spec, rule in (
            (SamplingSpec(0.7, top_k=20), "top_k=20 cannot keep"),
            (SamplingSpec(1.0, top_p=0.9), "top_p=0.9 drops"),
        ):
            with pytest.raises(LogprobsModeMismatch, match=rule) as exc:
                raw.generate(prompts, spec, max_tokens=4, seed=0)
            assert raw.url in str(exc.value) and "raw_logprobs" in str(exc.value)

        # Kill the server's process group once its engine is running the requests of a long generate.
        killed = threading.Event()
        killer = threading.Thread(target=kill_when_running, args=(raw, killed), daemon=True)
        killer.start()
        t0 = time.perf_counter()
        with pytest.raises(ServerDied, match=r"127\.0\.0\.1") as exc:
            raw.generate(make_prompts(raw.tokenizer(), 32), SamplingSpec(1.0), max_tokens=400, seed=0)
        assert killed.is_set(), f"the run ended before the kill: {exc.value}"
        assert time.perf_counter() - t0 < 60, "a dead server must end the run promptly, not at the timeout"
        print(f"\nkilled mid-run: {str(exc.value).splitlines()[0]}")
    finally:
        raw.close()
    assert_gone(raw)
    if raw.log_path is not None:  # kept because the ServerDied message cites it
        shutil.rmtree(raw.log_path.parent, ignore_errors=True)


# -- the module's processed-mode server ----------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


@pytest.fixture(scope="module")
def report(pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("server-report")
    cfg = RunConfig(
        model=MODEL, server="spawn", matrix=small_matrix(), out=out, plots=False, timeout_s=STARTUP_S
    )
    t0 = time.perf_counter()
    rep = run(cfg, progress=lambda s: None, pool=pool)
    rep["_seconds"] = time.perf_counter() - t0
    return rep


def server_of(pool: EnginePool) -> ServerRollout:
    rollout, _ = pool.get(MODEL, RunConfig(model=MODEL, server="spawn"), lambda s: None)
    assert isinstance(rollout, ServerRollout)
    return rollout


def test_default_matrix_passes_through_the_server(report, pool) -> None:
    failures = [v for s in report["scenarios"] for v in s["violations"]]
    assert report["passed"], "\n".join(failures)
    assert report["config"]["rollout"] == "vllm-server"
    assert [s["name"] for s in report["scenarios"]] == [s.name for s in small_matrix().scenarios]
    filtered = [s for s in report["scenarios"] if s["log_s"]["mean"] < -1e-3]
    assert len(filtered) >= 10 and all(s["incomplete_positions"] == 0 for s in report["scenarios"])
    print(f"\nmatrix of {len(report['scenarios'])} scenarios through the server: {report['_seconds']:.1f} s")


def _kept(rec, t: int) -> dict[int, float]:
    """Position ``t``'s captured kept set as {id: processed log-prob} (padding dropped)."""
    return {int(i): float(v) for i, v in zip(rec.kept_ids[t], rec.kept_logprobs[t], strict=True) if i >= 0}


def _max_gap(server, offline) -> float:
    """Two rollouts of the same prompts, seeds and spec: asserts equal tokens and equal kept sets (as sets:
    the server's head and the offline engine's may list the same ids in another order); returns the
    largest |log-prob diff|."""
    worst = 0.0
    for s, o in zip(server, offline, strict=True):
        assert (s.prompt_ids, s.seed, s.spec) == (o.prompt_ids, o.seed, o.spec), s.prompt_index
        assert list(s.completion_ids) == list(o.completion_ids), (s.spec.label(), s.prompt_index)
        worst = max(worst, float((s.logprobs.double() - o.logprobs.double()).abs().max()))
        assert (s.kept_ids is None) == (o.kept_ids is None), s.prompt_index
        for t in range(s.length if s.kept_ids is not None else 0):
            a, b = _kept(s, t), _kept(o, t)
            assert a.keys() == b.keys(), (s.spec.label(), s.prompt_index, t)
            worst = max([worst, *(abs(a[i] - b[i]) for i in a)])
    return worst


def test_server_matches_the_offline_engine(report, pool) -> None:
    """Same prompts, seeds and spec: the server's tokens, log-probs and kept sets equal the offline engine's."""
    from parity.engines.vllm_offline import VllmRollout

    server = server_of(pool)
    server.head = None
    prompts = make_prompts(server.tokenizer(), 4)
    got = {spec: server.generate(prompts, spec, max_tokens=8, seed=11) for spec in CROSS_SPECS}
    offline = VllmRollout(resolve_model(MODEL))
    try:
        diffs = {}
        for spec in CROSS_SPECS:
            assert sum(r.length for r in got[spec]) == 32
            diffs[spec.label()] = _max_gap(got[spec], offline.generate(prompts, spec, max_tokens=8, seed=11))
        # Adaptive capture (top_p / min_p without top_k), widened from a forced start of 4: same seeds, same
        # widening on both sides, the same kept sets at every position, none left unproven.
        server.start_head = offline.start_head = 4
        for spec in ADAPTIVE_SPECS:
            a = server.generate(prompts, spec, max_tokens=8, seed=11)
            s_stats = server.last_capture
            b = offline.generate(prompts, spec, max_tokens=8, seed=11)
            assert s_stats.widened_sequences >= 1 and s_stats.rounds >= 1, (spec.label(), s_stats)
            assert s_stats.incomplete_positions == 0 == offline.last_capture.incomplete_positions
            assert all(int(r.incomplete.sum()) == 0 for r in a + b)
            diffs[f"adaptive {spec.label()}"] = _max_gap(a, b)
    finally:
        server.start_head = None
        offline.close()
    worst = max(diffs.values())
    print(f"\noffline vs server max |log-prob diff| = {worst:.3g} ({diffs})")
    assert worst <= 1e-6, diffs


def test_attach_to_a_running_server(report, pool) -> None:
    spawned = server_of(pool)
    attached = ServerRollout(resolve_model(MODEL), server=spawned.url + "/v1", timeout_s=120)
    try:
        assert attached.pid is None and attached.served_model == spawned.served_model
        prompts = make_prompts(attached.tokenizer(), 3)
        spec = SamplingSpec(0.7, top_k=20, top_p=0.9)
        a = attached.generate(prompts, spec, max_tokens=6, seed=5)
        b = spawned.generate(prompts, spec, max_tokens=6, seed=5)
        assert _max_gap(a, b) == 0.0
        assert all(r.source == "vllm-server" for r in a)
    finally:
        attached.close()
    assert spawned.proc is not None and spawned.proc.poll() is None, (
        "closing an attached rollout must not stop the server"
    )


def test_shutdown_leaves_no_process(report, pool) -> None:
    rollout = server_of(pool)
    assert process_group_alive(rollout.pid) and server_processes(int(rollout.url.rsplit(":", 1)[1]))
    pool.close()
    assert_gone(rollout)
    with pytest.raises(Exception, match="closed"):
        rollout.generate([[1, 2]], SamplingSpec(), max_tokens=1, seed=0)
