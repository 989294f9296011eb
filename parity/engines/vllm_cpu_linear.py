"""Keep vLLM's CPU linear layers reading their own ``weight`` so that in-place weight updates take effect.

On CPU, vLLM 0.32 packs every dense linear weight after loading
(``vllm/model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm``, called from
``UnquantizedLinearMethod.process_weights_after_loading`` in ``linear.py`` with
``remove_weight=True``): the layer then computes from a oneDNN handle or a packed copy, and its
``weight`` is replaced by an empty ``Parameter`` that has no ``weight_loader``. A later
``model.load_weights(...)`` — what an RL trainer's colocated weight sync calls (TRL's
``VLLMGeneration.sync_weights``) — fails with ``AttributeError: 'Parameter' object has no attribute
'weight_loader'`` in ``linear.py`` ``load_weights``. Which CPUs and dtypes take a packing path is the
CPU's business (oneDNN always packs float32 on x86; bfloat16 where the CPU has AVX-512 BF16 or AMX),
so the crash is measured by the ``trl_weight_sync`` reproduction, never assumed.

:func:`keep_linear_weights` swaps that dispatch, for 2-D weights, for vLLM's own fallback
(``torch.nn.functional.linear`` on the layer's current ``weight``) and restores it on exit. Enter it
before the engine is built: the dispatch runs once, at load time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _linear_on_current_weight(x: Any, weight: Any, bias: Any) -> Any:
    import torch

    return torch.nn.functional.linear(x, weight, bias)


@contextlib.contextmanager
def keep_linear_weights() -> Iterator[dict[str, int]]:
    """Patch ``dispatch_cpu_unquantized_gemm`` so 2-D linear layers keep and read their ``weight``.

    Yields a counter ``{"kept": N, "delegated": M}``: layers given the plain fallback, and layers
    (non-2-D weights: conv, MoE experts) left to vLLM's own dispatch.
    """
    from vllm.model_executor.layers import utils as vllm_layer_utils

    original = vllm_layer_utils.dispatch_cpu_unquantized_gemm
    counts = {"kept": 0, "delegated": 0}

    def dispatch(layer: Any, remove_weight: bool) -> None:
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
