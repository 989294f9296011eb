"""TRL's real AsyncGRPOTrainer, one step on CUDA: its server started by TRL's own vllm_serve command (NCCL weight
transfer), its tree attention (FlashAttention-3), its own rollout worker. The logged step-0 ratio is S, not 1.

Skipped with a reason without CUDA (run by ``nox -s gpu``). Needs the ``kernels`` FA3 build in the local hub cache:
TRL fetches it at the first forward."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

MODEL = "qwen2-tiny"
START_TIMEOUT_S = 600.0


def _serve(path: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """TRL's own server command (``trl/scripts/vllm_serve.py`` ``build_command``), as ``trl vllm-serve`` runs it."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=str(path), port=port, host="127.0.0.1", gpu_memory_utilization=0.3,
                                        enforce_eager=True, max_model_len=1024))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"TRL's vLLM server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2.0):
                return proc
        except OSError:
            time.sleep(1.0)
    proc.kill()
    raise TimeoutError(f"TRL's vLLM server was not ready in {START_TIMEOUT_S:.0f} s")


def _one_step(path: Path, url: str, out: Path, **sampling: float) -> dict[str, float]:
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from parity.engines.trl_async import chat_tokenizer, parity_reward

    tok, _ = chat_tokenizer(path)
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Tell me about rivers number {i}"}]
                                       for i in range(8)]})
    args = AsyncGRPOConfig(output_dir=str(out), max_steps=1, num_generations=4, max_completion_length=16,
                           per_device_train_batch_size=8, logging_steps=1, report_to=[], vllm_server_base_url=url,
                           **sampling)
    trainer = AsyncGRPOTrainer(model=str(path), reward_funcs=parity_reward, args=args, train_dataset=ds,
                               processing_class=tok)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "ratio" in h]
    assert logged, trainer.state.log_history
    return logged[0]


def test_async_trainer_step_zero_ratio_is_s(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from parity.engines.vllm_server.process import free_port
    from parity.fixtures import build

    path = build(MODEL)
    port = free_port()
    proc = _serve(path, port, tmp_path / "server.log")
    try:
        url = f"http://127.0.0.1:{port}"
        control = _one_step(path, url, tmp_path / "top_p1", top_p=1.0)
        nucleus = _one_step(path, url, tmp_path / "top_p08", top_p=0.8)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # bf16 rounding moves each ratio by about 1e-2 on this model; S at top_p=0.8 lies in [0.8, 0.8 + p_min].
    assert abs(control["ratio"] - 1.0) < 0.02, control
    assert 0.78 < nucleus["ratio"] < 0.9, nucleus
    assert nucleus["clip_ratio/high_mean"] == 0.0, nucleus
    print(f"step 0: ratio {control['ratio']:.4f} at top_p=1, {nucleus['ratio']:.4f} at top_p=0.8", file=sys.stderr)
