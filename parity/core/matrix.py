"""Scenario matrices: the default one (every filter and their combinations) or a user's TOML file."""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from parity.core.spec import SPEC_FIELDS, SamplingSpec
from parity.errors import PathNotFound, UsageError

DEFAULT_TIE_FIXTURE = "qwen2-tiny-ties"
# A peaked checkpoint with a real-size vocabulary: 32768 tokens, logit scale 12 (|z| up to ~50). Cold
# temperatures push |z|/T towards 100, where float32 log-softmax rounding reaches ~1e-5: the scenarios
# that show the tolerances scale with |z|/T instead of firing on rounding.
DEFAULT_PEAKED_FIXTURE = "llama-32k-s12"


@dataclass(frozen=True)
class Scenario:
    name: str
    spec: SamplingSpec
    model: str | None = None  # None: the run's --model
    prompts: int = 8
    max_tokens: int = 16
    seed: int = 0
    capture_head: int | None = None  # None: chosen by parity.core.capture.plan_capture
    max_capture_head: int | None = None  # cap of adaptive capture (top_p/min_p without top_k); None: the run's
    # Engine settings RL turns on (None: the run's): prefix caching over a shared prompt prefix of
    # ``shared_prefix`` tokens (warmed before the scenario samples), chunked prefill at a step budget.
    prefix_caching: bool | None = None
    max_num_batched_tokens: int | None = None
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise UsageError(f"Scenario.name={self.name!r} is invalid: allowed a non-empty string")
        # (field, least value, None allowed)
        ints = (("prompts", 1, False), ("max_tokens", 1, False), ("max_num_batched_tokens", 16, True),
                ("shared_prefix", 0, True), ("max_capture_head", 2, True))
        for f, lo, optional in ints:
            v = getattr(self, f)
            if not (optional and v is None) and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
                raise UsageError(f"scenario {self.name!r}: {f}={v!r} is invalid: allowed an integer >= {lo}")
        if self.prefix_caching is not None and not isinstance(self.prefix_caching, bool):
            raise UsageError(f"scenario {self.name!r}: prefix_caching={self.prefix_caching!r} is invalid: allowed true or false")


@dataclass(frozen=True)
class Matrix:
    name: str
    scenarios: tuple[Scenario, ...]
    notes: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.scenarios:
            raise UsageError(f"matrix {self.name!r} has no scenarios: allowed at least one [[scenario]]")
        seen: set[str] = set()
        for s in self.scenarios:
            if s.name in seen:
                raise UsageError(f"matrix {self.name!r}: scenario name {s.name!r} is used twice: allowed unique names")
            seen.add(s.name)


def default_matrix(*, prompts: int = 8, max_tokens: int = 16, seed: int = 0) -> Matrix:
    """Every filter alone at each level, the filters in pairs across temperatures, all at once, ties, penalties. Levels:
    temperature {0, 0.7, 1.0, 1.3}, top_p {1, 0.95, 0.9, 0.8, 0.05}, top_k {off, 1, 20, 50, >= V}, min_p
    {0, 0.05, 0.1}; `pair_coverage` lists which level pairs of which factors appear together (report.md prints it)."""
    def _s(name: str, t: float = 1.0, k: int = 0, p: float = 1.0, m: float = 0.0, model: str | None = None,
           **penalties: float) -> Scenario:
        spec = SamplingSpec(temperature=t, top_k=k, top_p=p, min_p=m, **penalties)
        return Scenario(name=name, spec=spec, model=model, prompts=prompts, max_tokens=max_tokens, seed=seed)

    rows = [
        _s("baseline T=1"),
        _s("greedy T=0", t=0.0),
        _s("T=0.7", t=0.7),
        _s("T=1.3", t=1.3),
        _s("top_p=0.95", p=0.95),
        _s("top_p=0.9 T=0.7", t=0.7, p=0.9),
        _s("top_p=0.8 T=1.3", t=1.3, p=0.8),
        _s("top_p=0.05", p=0.05),
        _s("top_k=1", k=1),
        _s("top_k=20 T=1.3", t=1.3, k=20),
        _s("top_k=50 T=0.7", t=0.7, k=50),
        _s("top_k=40 T=0.3", t=0.3, k=40),
        _s("top_k>=V", k=1_000_000),
        _s("min_p=0.05", m=0.05),
        _s("min_p=0.1 T=1.3", t=1.3, m=0.1),
        _s("top_k=20 top_p=0.9", k=20, p=0.9),
        _s("top_k=50 min_p=0.05 T=1.3", t=1.3, k=50, m=0.05),
        _s("top_p=0.8 min_p=0.1 T=0.7", t=0.7, p=0.8, m=0.1),
        _s("all filters T=0.7", t=0.7, k=50, p=0.95, m=0.05),
        _s("all filters T=1.3", t=1.3, k=20, p=0.8, m=0.1),
        # Penalties: vLLM applies them before temperature and the filters, from each sequence's own history.
        _s("repetition_penalty=1.3 top_p=0.9 T=0.7", t=0.7, p=0.9, repetition_penalty=1.3),
        _s("presence=0.5 frequency=0.3 top_k=50", k=50, presence_penalty=0.5, frequency_penalty=0.3),
        _s("ties top_k=1", k=1, model=DEFAULT_TIE_FIXTURE),
        _s("ties top_k=2", k=2, model=DEFAULT_TIE_FIXTURE),
        _s("ties top_k=3 top_p=0.9", k=3, p=0.9, model=DEFAULT_TIE_FIXTURE),
        _s("peaked 32k top_k=40 T=0.3", t=0.3, k=40, model=DEFAULT_PEAKED_FIXTURE),
        _s("peaked 32k top_k=100 top_p=0.9 T=0.5", t=0.5, k=100, p=0.9, model=DEFAULT_PEAKED_FIXTURE),
    ]
    return Matrix("default", tuple(rows))


FACTORS: dict[str, Callable[[SamplingSpec], str]] = {
    "temperature": lambda s: "0" if s.greedy else ("<1" if s.temperature < 1 else ("1" if s.temperature == 1 else ">1")),
    "top_k": lambda s: "off" if not s.uses_top_k else str(s.top_k) if s.top_k < 1_000_000 else ">=V",
    "top_p": lambda s: "1" if not s.uses_top_p else f"{s.top_p:g}",
    "min_p": lambda s: "0" if not s.uses_min_p else f"{s.min_p:g}",
    "penalties": lambda s: "off" if not s.penalised else "on",
}


def pair_coverage(matrix: Matrix) -> dict[str, list[str]]:
    """For each pair of factors, the level pairs that appear together in some scenario."""
    out: dict[str, list[str]] = {}
    for a, b in itertools.combinations(FACTORS, 2):
        pairs = {(FACTORS[a](s.spec), FACTORS[b](s.spec)) for s in matrix.scenarios}
        out[f"{a} x {b}"] = sorted(f"{x}/{y}" for x, y in pairs)
    return out


# Matrices shipped with the package, by name (parity/data/): the real-checkpoint scenarios of the main job.
NAMED_MATRICES = {"real": "real_checkpoint.toml", "real-bf16": "real_checkpoint_bf16.toml", "penalties": "penalties.toml"}


def load_matrix(path: str | Path) -> Matrix:
    """A TOML matrix (``[defaults]`` and ``[[scenario]]`` tables: docs/internals.md, section 3), or the packaged
    file of a name of :data:`NAMED_MATRICES`."""
    if str(path) in NAMED_MATRICES:
        return load_matrix(Path(__file__).resolve().parent.parent / "data" / NAMED_MATRICES[str(path)])
    p = Path(path)
    if not p.is_file():
        raise PathNotFound(f"matrix file {str(path)!r} does not exist: allowed 'default', "
                           f"{', '.join(map(repr, NAMED_MATRICES))} or a TOML file")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"matrix file {str(path)!r} is not valid TOML: {exc}") from exc
    defaults = data.get("defaults", {})
    allowed_defaults = {"prompts", "max_tokens", "seed", "model"}
    if set(defaults) - allowed_defaults:
        raise UsageError(f"matrix [defaults] has unknown key(s) {sorted(set(defaults) - allowed_defaults)}: allowed {sorted(allowed_defaults)}")
    rows = data.get("scenario")
    if not isinstance(rows, list) or not rows:
        raise UsageError(f"matrix file {str(path)!r} has no [[scenario]] tables")
    spec_keys = set(SPEC_FIELDS)
    other = {"name", "model", "prompts", "max_tokens", "seed", "capture_head", "max_capture_head", "prefix_caching",
             "max_num_batched_tokens", "shared_prefix"}
    scenarios = []
    for i, row in enumerate(rows):
        unknown = set(row) - spec_keys - other
        if unknown:
            raise UsageError(f"matrix scenario #{i + 1} has unknown key(s) {sorted(unknown)}: allowed {sorted(spec_keys | other)}")
        spec = SamplingSpec(**{k: row[k] for k in spec_keys if k in row})
        merged = {**defaults, **{k: row[k] for k in other if k in row}}
        merged.setdefault("name", f"scenario {i + 1} {spec.label()}")
        scenarios.append(Scenario(spec=spec, **merged))
    return Matrix(p.stem, tuple(scenarios))


