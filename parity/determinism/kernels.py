"""Batch-invariant CPU kernels for a transformers causal LM's forward: the installer.

While ``enable`` is in force, a ``TorchDispatchMode`` around the given models' ``forward`` routes the
operations of ``op_kernels.KERNELS`` to their batch-invariant replacements, attention goes through
``attention_kernel``, and every operation is counted (replaced, exact, uncovered).
What was measured and each kernel: docs/batch_invariance.md.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import ParamSpec, TypeVar, cast

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from parity.determinism.attention_kernel import (
    ATTENTION_KERNEL,
    ATTENTION_NAME,
    CHUNK,
    TLS,
    SwitchesAttention,
    attention_forward,
    implementation,
)
from parity.determinism.op_kernels import KERNELS
from parity.errors import UsageError
from parity.report.blocks import Json, JsonObject

# Floating-point operations whose result is exact (data movement, comparisons, IEEE + - * /,
# max/min, rounding casts) and so cannot depend on the layout; sqrt is not among them (see rsqrt64).
# Every other floating-point operation seen in a forward is counted in ``other_ops``.
EXACT_OPS = frozenset(
    """
    view _unsafe_view reshape t transpose permute expand unsqueeze squeeze slice select index index_select
    gather embedding cat stack clone _to_copy copy_ alias detach lift_fresh new_ones new_zeros new_empty
    new_full zeros ones full empty empty_strided empty_like zeros_like ones_like full_like arange
    scalar_tensor where masked_fill masked_fill_ bitwise_and bitwise_or bitwise_not bitwise_xor eq ne lt
    le gt ge logical_and logical_or logical_not logical_xor add sub mul div neg abs maximum minimum clamp
    clamp_min clamp_max reciprocal amax amin max min argmax argmin any all isnan isinf isfinite
    constant_pad_nd fill fill_ zero_ split split_with_sizes chunk unbind sort topk _local_scalar_dense
    flip roll repeat repeat_interleave nonzero masked_select round floor ceil trunc sign nan_to_num frexp
    bitwise_left_shift bitwise_right_shift diff unfold narrow as_strided contiguous _assert_tensor_metadata
    """.split()
)


def _has_float(args: Iterable[object]) -> bool:
    stack = list(args)
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            if a.is_floating_point() or a.is_complex():
                return True
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
    return False


class Undo:
    """Restore actions, run last-in first-out; every one runs even if an earlier one raises, then ``failed``
    (formatted with ``n`` and ``errors``) is raised."""

    def __init__(self, failed: str) -> None:
        self.failed = failed
        self._actions: list[Callable[[], object]] = []

    def push(self, fn: Callable[[], object]) -> None:
        self._actions.append(fn)

    def run(self) -> None:
        errors = []
        while self._actions:
            try:
                self._actions.pop()()
            except Exception as exc:  # noqa: BLE001 - collected and re-raised below
                errors.append(exc)
        if errors:
            raise RuntimeError(self.failed.format(n=len(errors), errors=errors))


class _KernelMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves __init_subclass__ unannotated
    """Routes the operations in ``KERNELS`` to this module's kernels and counts every operation."""

    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode.__init__ unannotated
        self.kernels = kernels

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if TLS.bypass:
            return func(*args, **kwargs)
        entry = KERNELS.get(func)
        if entry is not None and all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor)):
            out = entry[0](*args, **kwargs)
            if out is not NotImplemented:
                self.kernels.count_call(str(func.overloadpacket.__name__ + "." + func._overloadname))
                return out
        self.kernels.count_op(func, args)
        return func(*args, **kwargs)


class CpuKernels:
    """The kernel set installed on some models: what was replaced and what the forwards ran.

    ``report`` is a live dict (the ``batch_invariant_mode`` state holds it): ``replaced`` names each
    kernel and how it computes; ``calls`` counts replaced calls; ``exact_ops`` counts exact operations;
    ``other_ops`` counts floating-point operations neither replaced nor exact, by name.
    """

    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        self.models = list(models)
        self.exact = 0
        replaced: JsonObject = {
            f"{op.overloadpacket.__name__}.{op._overloadname}": how for op, (_, how) in KERNELS.items()
        }
        # report["calls"] and report["other_ops"]: counted into as the forwards run.
        self.calls: dict[str, int] = {}
        self.other: dict[str, int] = {}
        models_json: list[Json] = [type(m).__name__ for m in self.models]
        self.report: JsonObject = {
            "replaced": replaced | {"attention": ATTENTION_KERNEL},
            "attention_implementation": ATTENTION_NAME,
            "attention_chunk": CHUNK,
            "models": models_json,
            "calls": cast("Json", self.calls),
            "exact_ops": 0,
            "other_ops": cast("Json", self.other),
        }
        self._undo = Undo("cpu kernels: {n} restore step(s) failed: {errors}")

    def count_call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def count_op(self, func: OpOverload, args: Iterable[object]) -> None:
        name = func.overloadpacket.__name__
        if name in EXACT_OPS or not _has_float(args):
            self.exact += 1
            self.report["exact_ops"] = self.exact
            return
        key = f"{name}.{func._overloadname}"
        self.other[key] = self.other.get(key, 0) + 1

    # -- install / restore -------------------------------------------------------------------------

    def _wrap_forward(self, model: torch.nn.Module) -> None:
        own = model.__dict__.get("forward")
        inner = model.forward
        kernels = self

        def forward(*args: object, **kwargs: object) -> object:
            if TLS.active is not None:  # already inside a model under the kernels (a nested call)
                return inner(*args, **kwargs)
            TLS.active = kernels
            try:
                with _KernelMode(kernels):
                    return inner(*args, **kwargs)
            finally:
                TLS.active = None

        model.forward = forward

        def restore() -> None:
            if own is None:
                del model.forward
            else:
                model.forward = own

        self._undo.push(restore)

    def _switch_attention(self, model: torch.nn.Module) -> None:
        if not isinstance(model, SwitchesAttention):
            raise UnsupportedModel(f"{type(model).__name__} has no set_attn_implementation")
        prev = model.config._attn_implementation
        if prev != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
            self._undo.push(functools.partial(model.set_attn_implementation, prev))

    def enable(self) -> CpuKernels:
        try:
            _register()
            self._undo.push(_unregister)
            for m in self.models:
                self._switch_attention(m)
                self._wrap_forward(m)
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self) -> None:
        self._undo.run()


# One registration of the attention and mask functions per process while any kernel set is enabled.
_REGISTERED = {"count": 0, "added": False}
_LOCK = threading.Lock()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _materialised(mask_function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Boolean 4D masks (transformers' ``sdpa_mask``), always materialised: the kernel reads each
    query's key range from the mask, so a plain causal batch must not come as None plus is_causal."""

    def mask(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        kwargs["allow_is_causal_skip"] = False
        return mask_function(*args, **kwargs)

    return mask


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    with _LOCK:
        if _REGISTERED["count"] == 0:
            present = ATTENTION_NAME in AttentionInterface._global_mapping
            if not present:
                AttentionInterface.register(ATTENTION_NAME, attention_forward)
                AttentionMaskInterface.register(ATTENTION_NAME, _materialised(sdpa_mask))
            _REGISTERED["added"] = not present
        _REGISTERED["count"] += 1


def _unregister() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _LOCK:
        _REGISTERED["count"] -= 1
        if _REGISTERED["count"] == 0 and _REGISTERED["added"]:
            AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
            AttentionMaskInterface._global_mapping.pop(ATTENTION_NAME, None)
            _REGISTERED["added"] = False


class UnsupportedModel(UsageError):
    """A model the kernel set cannot be installed on (the reason names what is missing)."""


def check_model(model: object) -> torch.nn.Module:
    """``model``, checked: a transformers model with its parameters on CPU (else UnsupportedModel)."""
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModel(
            f"{type(model).__name__} is not a torch.nn.Module: allowed a transformers model"
        )
    config = getattr(model, "config", None)
    if (
        config is None
        or not isinstance(model, SwitchesAttention)
        or not hasattr(config, "_attn_implementation")
    ):
        raise UnsupportedModel(
            f"{type(model).__name__} has no transformers config with an attention implementation "
            "(set_attn_implementation): allowed a transformers PreTrainedModel"
        )
    dev = {p.device.type for p in model.parameters()}
    if dev - {"cpu"}:
        raise UnsupportedModel(
            f"{type(model).__name__} has parameters on {sorted(dev)}: the CPU kernels allow 'cpu'"
        )
    return model


def enable(models: Sequence[object]) -> CpuKernels:
    """Install the kernel set on ``models`` (checked first); ``restore()`` on the result undoes it."""
    return CpuKernels([check_model(m) for m in models]).enable()


def is_enabled(model: object) -> bool:
    """Whether ``model`` currently runs under a kernel set (its attention is this module's)."""
    attrs: object = getattr(model, "__dict__", {})
    switched = implementation(getattr(model, "config", None)) == ATTENTION_NAME
    return switched and isinstance(attrs, Mapping) and "forward" in attrs
