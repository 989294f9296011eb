"""parity: does the trainer score the exact distribution the vLLM sampler drew from?

The top-level package holds only the engine-free math core; engines are imported lazily.
"""

from parity.core.estimators import full, predicted_log_s, recompute, replay
from parity.core.filters import FilterResult, reference_filter
from parity.core.spec import SamplingSpec

__version__ = "0.1.0"

__all__ = [
    "FilterResult",
    "SamplingSpec",
    "__version__",
    "full",
    "predicted_log_s",
    "recompute",
    "reference_filter",
    "replay",
]
