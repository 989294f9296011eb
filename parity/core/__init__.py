"""The engine-free math core: tensors in, tensors out; no vLLM or transformers import.

- :mod:`~parity.core.spec`: the sampling spec and vLLM's parameter rules.
- :mod:`~parity.core.filters`: the reference filters (temperature, top_k, top_p, min_p), vLLM's order.
- :mod:`~parity.core.estimators`: the trainer-side estimators (full, replay, recompute, log S).
- :mod:`~parity.core.capture`: which support the rollout side captures and how it is read back.
- :mod:`~parity.core.token_table`: per-token comparison table of both sides and its summary.
- :mod:`~parity.core.metrics`: the comparison rule for differences, support equality, KL/TV over a support.
- :mod:`~parity.core.gates`: thresholds and the gates that turn a summary into violations.
- :mod:`~parity.core.matrix`: scenario matrices (default and TOML).
- :mod:`~parity.core.tolerances`: float32 rounding bands of vLLM's filters (recompute's top_k candidate path).
"""
