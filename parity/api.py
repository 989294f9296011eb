"""parity's public API: the names README's examples use. Every other module is internal and may move.

Each name imports its module when first read, so ``import parity.api`` costs nothing until then (TRL, vLLM
and matplotlib are imported only by the names that need them)."""

from __future__ import annotations

from parity import lazy_module

# name -> the module that defines it
_NAMES = {
    "run": "parity.run",
    "RunConfig": "parity.run",
    "analyze": "parity.analyze.report",
    "load_report": "parity.report.model",
    "write_records": "parity.records.write",
    "patch_grpo": "parity.engines.trl_grpo",
    "SamplingSpec": "parity.core.spec",
    "TrainerBatch": "parity.engines.trainer_under_test",
    "trace_routers": "parity.engines.routing_replay",
    **{e: "parity.errors" for e in ("ParityError", "UsageError", "PathNotFound", "SetupError", "MissingPackage",
                                    "EngineError", "TimedOut")},
}

__all__ = sorted(_NAMES)


__getattr__, __dir__ = lazy_module("parity.api", _NAMES, globals())
