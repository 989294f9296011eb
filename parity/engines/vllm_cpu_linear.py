"""Keep vLLM's CPU linear layers reading their own ``weight`` so that in-place weight updates take effect.

Without :func:`keep_linear_weights` (entered before the engine is built) a colocated weight sync fails on
``weight_loader`` (docs/internals.md, section 5)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _linear_on_current_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    import torch

    return torch.nn.functional.linear(x, weight, bias)


@contextlib.contextmanager
def keep_linear_weights() -> Iterator[dict[str, int]]:
    """Patch ``dispatch_cpu_unquantized_gemm`` so 2-D linear layers keep and read their ``weight``; yields a counter
    ``{"kept": N, "delegated": M}``: layers given the plain fallback, and layers (non-2-D weights: conv, MoE
    experts) left to vLLM's own dispatch."""
    from vllm.model_executor.layers import utils as vllm_layer_utils

    original = vllm_layer_utils.dispatch_cpu_unquantized_gemm
    counts = {"kept": 0, "delegated": 0}

    def dispatch(layer: Any, remove_weight: bool) -> None:  # a vLLM linear layer
        weight = getattr(layer, "weight", None)
        if weight is None or weight.is_meta or weight.ndim != 2:
            counts["delegated"] += 1
            original(layer, remove_weight)
            return
        # vLLM's own fallback branch of the same function: compute from the weight the layer holds now.
        layer.cpu_linear = _linear_on_current_weight
        counts["kept"] += 1

    vllm_layer_utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield counts
    finally:
        vllm_layer_utils.dispatch_cpu_unquantized_gemm = original
