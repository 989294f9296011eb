"""Batch invariance: the knobs that should give it (:mod:`~parity.determinism.knobs`), the checks that
measure it on both sides (:mod:`~parity.determinism.checks`), the gate and report section
(:mod:`~parity.determinism.gate`), and how the engine keeps ties per batch size
(:mod:`~parity.determinism.ties`)."""
