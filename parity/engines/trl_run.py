"""Run TRL's real ``GRPOTrainer`` on a fixture model on CPU, one configuration, in this process.

Phases ``observe`` then the fix, each a fresh trainer under :func:`parity.engines.trl_grpo.patch_grpo`; the
command, setup and outputs: docs/internals.md, section 5."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from parity.engines.session import PROMPT_TEXTS
from parity.errors import UsageError

if TYPE_CHECKING:
    from trl import GRPOTrainer

IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")
# TRL's logged metrics this run reads back (GRPOTrainer._generate_and_score_completions).
TRL_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
               "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
               "sampling/importance_sampling_ratio/max")
PROMPTS = tuple(PROMPT_TEXTS[i] for i in (0, 1, 3, 5))


@dataclass(frozen=True)
class GrpoRunConfig:
    """One GRPO configuration; validated before anything heavy is imported."""

    model: str = "qwen2-tiny"  # a fixture name or a checkpoint directory with a tokenizer
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # GRPOConfig.repetition_penalty: vLLM applies it, TRL's trainer side does not
    is_mode: str = "sequence_mask"
    steps: int = 2
    batch: int = 8  # completions per step (per_device_train_batch_size)
    num_generations: int = 4
    max_completion_length: int = 16
    seed: int = 0
    phases: tuple[str, ...] = ("observe", "replay")
    head: int | None = None  # processed log-probs requested per position (None: parity.core.capture.plan_capture)
    keep_logits: bool = True
    vllm_dtype: str | None = None  # None: what TRL does (no dtype); "float32" forces the engine's dtype
    keep_linear_weights: bool = True  # the CPU engine workaround; False reproduces the weight-sync crash
    extra: dict[str, object] = field(default_factory=dict)  # more GRPOConfig fields, passed through

    def __post_init__(self) -> None:
        from parity.core.spec import SamplingSpec
        from parity.engines.trl_grpo import MODES

        SamplingSpec(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)  # raises naming the field
        if self.is_mode not in IS_MODES:
            raise UsageError(f"GrpoRunConfig.is_mode={self.is_mode!r} is invalid: allowed {', '.join(IS_MODES)}")
        for name in ("steps", "batch", "max_completion_length"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"GrpoRunConfig.{name}={v!r} is invalid: allowed an integer >= 1")
        if not isinstance(self.num_generations, int) or self.num_generations < 2 or self.batch % self.num_generations:
            raise UsageError(f"GrpoRunConfig.num_generations={self.num_generations!r} is invalid: allowed an "
                             f"integer >= 2 that divides batch={self.batch}")
        bad = [p for p in self.phases if p not in (*MODES, "off")]
        if not self.phases or bad:
            raise UsageError(f"GrpoRunConfig.phases={self.phases!r} is invalid: allowed a non-empty list of "
                             f"off, {', '.join(MODES)}")
        if self.vllm_dtype not in (None, "float32", "bfloat16", "float16"):
            raise UsageError(f"GrpoRunConfig.vllm_dtype={self.vllm_dtype!r} is invalid: allowed null, float32, bfloat16, float16")
        object.__setattr__(self, "phases", tuple(self.phases))

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> GrpoRunConfig:
        if unknown := set(data) - set(known := cls.__dataclass_fields__):
            raise UsageError(f"GrpoRunConfig got unknown field(s) {sorted(unknown)}: allowed {sorted(known)}")
        build: Callable[..., GrpoRunConfig] = cls  # __post_init__ checks the values
        return build(**data)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def label(self) -> str:
        from parity.core.spec import SamplingSpec

        return SamplingSpec(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty).label()


def configure_process(port: int | None = None) -> None:
    """The one-process gloo group and CPU engine settings; before torch.distributed/vLLM start."""
    from parity.engines.vllm_offline import configure_cpu_env
    from parity.engines.vllm_server.process import free_port

    configure_cpu_env()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port or free_port())
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


def _reward_length(completions: list[Sized], **_: object) -> list[float]:
    """The reward is arbitrary: the IS correction does not depend on it."""
    return [float(len(c)) for c in completions]


def _trainer(cfg: GrpoRunConfig, model_path: str, out_dir: str) -> GRPOTrainer:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(cfg.steps * cfg.batch // cfg.num_generations)]
    args = GRPOConfig(
        output_dir=out_dir, use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False,
        per_device_train_batch_size=cfg.batch, num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length, max_steps=cfg.steps, logging_steps=1, report_to=[],
        save_strategy="no", seed=cfg.seed, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        min_p=cfg.min_p if cfg.min_p > 0 else None, repetition_penalty=cfg.repetition_penalty,
        vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=cfg.is_mode,
        vllm_max_model_length=256, dataloader_num_workers=0, **cfg.extra,
    )
    return GRPOTrainer(model=model_path, reward_funcs=_reward_length, args=args,
                       train_dataset=Dataset.from_dict({"prompt": prompts}))


@contextlib.contextmanager
def _force_dtype(dtype: str | None) -> Iterator[None]:
    """Build TRL's colocated engine with ``dtype`` (TRL itself passes none)."""
    if dtype is None:
        yield
        return
    from trl.generation import vllm_generation as vg

    original = vg.LLM

    def make(*a: object, **k: object) -> object:
        return original(*a, **{**k, "dtype": dtype})

    vg.LLM = make
    try:
        yield
    finally:
        vg.LLM = original


def _shutdown(trainer: GRPOTrainer) -> None:
    gen = getattr(trainer, "vllm_generation", None)
    llm = getattr(gen, "llm", None)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def run_phase(cfg: GrpoRunConfig, mode: str, model_path: str, out: Path) -> dict[str, object]:
    """One fresh trainer, ``cfg.steps`` steps, under ``patch_grpo(mode)``; TRL's metrics and the capture."""
    from parity.engines.trl_grpo import engine_dtype, patch_grpo, save_sequences
    from parity.engines.vllm_cpu_linear import keep_linear_weights

    t0 = time.perf_counter()
    # "off": TRL as shipped, no parity patch (only the engine workaround); nothing is captured.
    recorder = contextlib.nullcontext(None) if mode == "off" else patch_grpo(mode, head=cfg.head, keep_logits=cfg.keep_logits)
    workaround = keep_linear_weights() if cfg.keep_linear_weights else contextlib.nullcontext({"kept": 0})
    with tempfile.TemporaryDirectory(prefix="parity-trl-") as tmp, workaround as kept, \
            recorder as cap, _force_dtype(cfg.vllm_dtype):
        trainer = _trainer(cfg, model_path, tmp)
        t_init = time.perf_counter() - t0
        gen = getattr(trainer, "vllm_generation", None)
        print(f"PARITY_TRAINER_READY vllm_dtype={engine_dtype(gen)}", flush=True)
        try:
            trainer.train()
        finally:
            _shutdown(trainer)
        history = trainer.state.log_history
        vllm_dtype = engine_dtype(gen)
        del trainer, gen
        gc.collect()
    metrics = [{k: h[k] for k in TRL_METRICS if k in h} | {"step": h.get("step")} for h in history
               if any(k in h for k in TRL_METRICS)]
    path = save_sequences(cap.sequences, out / f"{mode}.pt") if cap is not None else None
    dtypes = sorted({str(s["sampler_dtype"]) for s in cap.sequences}) if cap is not None else []
    return {"mode": mode, "metrics": metrics, "counts": cap.counts if cap is not None else None,
            "capture_plans": cap.capture_plans if cap is not None else None,
            "linear_layers_kept": kept["kept"], "vllm_dtype": vllm_dtype,
            "sampler_dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
            "capture": path.name if path is not None else None, "init_s": round(t_init, 2),
            "seconds": round(time.perf_counter() - t0, 2)}


def run(cfg: GrpoRunConfig, out: Path) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    configure_process()
    from parity.fixtures import resolve_model

    model_path = str(resolve_model(cfg.model))
    t_imp = time.perf_counter()
    import trl
    import vllm

    import_s = time.perf_counter() - t_imp
    phases = [run_phase(cfg, mode, model_path, out) for mode in cfg.phases]
    result = {"config": cfg.to_dict(), "label": cfg.label(), "model_path": model_path, "trl": trl.__version__,
              "vllm": vllm.__version__, "phases": phases, "import_s": round(import_s, 2),
              "seconds": round(time.perf_counter() - t0, 2)}
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parity.engines.trl_run", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="{}", help="GrpoRunConfig fields as a JSON object")
    p.add_argument("--out", type=Path, required=True, help="folder for result.json and the captures")
    args = p.parse_args(argv)
    cfg = GrpoRunConfig.from_dict(json.loads(args.config))
    run(cfg, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
