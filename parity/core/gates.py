"""Gate thresholds per dtype and ci/thresholds.toml. The gates themselves are one table:
:data:`parity.judge.gate_table.GATE_TABLE`.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from parity.errors import PathNotFound, UsageError


@dataclass(frozen=True)
class Thresholds:
    """Gate limits; drift is gated against the error model (docs/error_model.md), not a constant.
    ``max_headroom``: a per-token comparison passes when ``|diff| <= max_headroom * bound``, the bound from
    both sides' dtype, the token's scaled logits and the support size; ``mean_bias_headroom``: the same for
    ``|mean diff|`` against :func:`mean_bias_limit`."""

    max_headroom: float = 1.0
    mean_bias_headroom: float = 1.0
    replay_support_equal_frac: float = 1.0
    recompute_support_equal_frac: float = 0.99  # the boundary may move under numerics; force-include covers it
    max_incomplete_frac: float = 1.0  # opt-in: below 1 an unproven capture fails (else it is a stated limit)
    max_sampled_outside: int = 0
    max_token_mismatch: int = 0
    max_violations_listed: int = 5
    max_trainer_support_failures: int = 0  # sampled tokens the trainer gives no probability (-inf) or NaN

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or v < 0:
                raise UsageError(f"Thresholds.{f.name}={v!r} is invalid: allowed a number >= 0")
        for name in ("replay_support_equal_frac", "recompute_support_equal_frac", "max_incomplete_frac"):
            if getattr(self, name) > 1:
                raise UsageError(f"Thresholds.{name}={getattr(self, name)!r} is invalid: allowed a fraction in [0, 1]")

    @classmethod
    def for_dtype(cls, dtype: str) -> Thresholds:
        """Defaults per dtype (the looser of the two sides'): headroom 1 for every drift limit, as the error model
        scales with the dtype; below float32 recompute's support is reported, not gated (docs/error_model.md,
        section 4)."""
        if dtype == "float32":
            return cls()
        if dtype in ("bfloat16", "float16"):
            return cls(recompute_support_equal_frac=0.0)
        raise UsageError(f"dtype={dtype!r} has no default thresholds: allowed float32, bfloat16, float16")

    def override(self, **changes: float) -> Thresholds:
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise UsageError(f"unknown threshold(s) {sorted(unknown)}: allowed {[f.name for f in fields(self)]}")
        return type(self)(**{**asdict(self), **changes})  # as replace(): __post_init__ checks each value

    @classmethod
    def from_toml(cls, path: str | Path, dtype: str = "float32") -> Thresholds:
        """``[thresholds]`` (all dtypes) and ``[thresholds.<dtype>]`` tables override the defaults."""
        p = Path(path)
        if not p.is_file():
            raise PathNotFound(f"thresholds file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"thresholds file {str(path)!r} is not valid TOML: {exc}") from exc
        table = data.get("thresholds", data)
        if not isinstance(table, dict):
            raise UsageError(f"thresholds file {str(path)!r}: thresholds = {table!r}; allowed a table of name = value")
        per_dtype = table[dtype] if isinstance(table.get(dtype), dict) else {}
        shared = {k: v for k, v in table.items() if k != "schema_version" and not isinstance(v, dict)}
        return cls.for_dtype(dtype).override(**shared, **per_dtype)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def recompute_support_limit(frac: float, n: int) -> float:
    """The recompute support gate's limit on the equal fraction over ``n`` positions: the threshold less
    three binomial standard errors of its rate of moved boundaries (numerics move a top_p boundary now
    and then, and one moved boundary among 80 positions is not a wrong filter; a wrong filter moves
    them at far more)."""
    if n <= 0:
        return frac
    p = 1.0 - frac
    return max(0.0, frac - 3.0 * math.sqrt(p * (1.0 - p) / n))


# -- the thresholds file -------------------------------------------------------------------------
# ci/thresholds.toml is generated from Thresholds.for_dtype (tests/test_ci_gate.py checks it is
# current); the numbers live in the code only. Regenerate with:
#   python -c "from parity.core.gates import thresholds_toml; print(thresholds_toml(), end='')" > ci/thresholds.toml
THRESHOLD_DTYPES = ("float32", "bfloat16", "float16")
THRESHOLDS_SCHEMA_VERSION = 2
_NOT_A_LIMIT = ("max_violations_listed",)  # how many violations a report lists, not a gate
_THRESHOLDS_TOML_NOTES = """\
# parity gate thresholds. Bump schema_version when a key is renamed or its meaning changes (2: the
# absolute drift limits became headroom against the error model of parity.core.error_model).
# Keys are parity.core.gates.Thresholds fields; [thresholds] applies to every dtype, [thresholds.<dtype>]
# to the trainer dtype in use. Drift is gated as |diff| <= max_headroom x a per-token rounding bound
# derived from both sides' dtype, |z|/T and the support size, so one headroom serves every dtype and
# device; the GPU gate's first reports (reports/gpu/*/report.md) say how much of it CUDA kernels use.
# recompute_support_equal_frac is not gated (0) when a side runs in bfloat16/float16: its logits move by
# more than the gaps at a filter boundary (smollm2-135m, bf16 sampler: the recomputed set equalled S_q at
# 15-77 % of positions); the support equality is still reported.
"""


def _toml_number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    text = repr(float(v))
    if "e" in text:
        mantissa, exp = text.split("e")
        return f"{mantissa}e{int(exp)}"
    return text


def thresholds_toml() -> str:
    """ci/thresholds.toml, generated from :meth:`Thresholds.for_dtype`: the limits every dtype shares
    under ``[thresholds]``, the rest under ``[thresholds.<dtype>]``."""
    per = {d: Thresholds.for_dtype(d).to_dict() for d in THRESHOLD_DTYPES}
    keys = [f.name for f in fields(Thresholds) if f.name not in _NOT_A_LIMIT]
    shared = [k for k in keys if len({per[d][k] for d in THRESHOLD_DTYPES}) == 1]
    lines = [
        "# Generated from parity.core.gates.Thresholds.for_dtype; do not edit. Change the code, then run",
        "#   python -c \"from parity.core.gates import thresholds_toml; print(thresholds_toml(), end='')\" > ci/thresholds.toml",
        *_THRESHOLDS_TOML_NOTES.splitlines(),
        f"schema_version = {THRESHOLDS_SCHEMA_VERSION}",
        "",
        "[thresholds]",
        *(f"{k} = {_toml_number(per['float32'][k])}" for k in shared),
    ]
    for d in THRESHOLD_DTYPES:
        lines += ["", f"[thresholds.{d}]", *(f"{k} = {_toml_number(per[d][k])}" for k in keys if k not in shared)]
    return "\n".join(lines) + "\n"
