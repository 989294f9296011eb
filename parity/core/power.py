"""The power of a mean-bias verdict: could its gate have failed the bias class it exists to catch? Its
resolution (``headroom × limit``: a systematic part plus a statistical one shrinking as ``1 / sqrt(tokens)``)
must lie below the class bias (``|log S|``: what a full-vocabulary trainer is off by); where it does not, the
tokens that would resolve it follow from the measured spread (docs/power.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from parity.core.display import apart

# parity run samples this many times the tokens the measured spread asks for: the spread and log S are
# themselves estimates from the first, smaller batch.
SAMPLING_MARGIN = 1.25


@dataclass(frozen=True)
class Power:
    """One mean-bias gate's resolution against the class bias it exists to catch."""

    gate: str
    class_bias: float  # |log S| (mean over the scenario's tokens); NaN where the records hold no log S
    resolution: float  # headroom × the gate's limit: the smallest |mean bias| it fails
    systematic: float  # headroom × the limit's systematic part (no count of tokens lowers it)
    tokens: int  # tokens the resolution was measured over
    tokens_needed: int | None  # tokens at which the resolution would lie below the class bias (None: none)
    penalised: bool = False  # the class also leaves the sampler's penalties out: its bias is log S - penalty term

    @property
    def resolved(self) -> bool | None:
        """None: the class bias is unknown (NaN), so is the power."""
        return None if math.isnan(self.class_bias) else self.resolution < self.class_bias

    def to_json(self) -> dict[str, object]:
        known = not math.isnan(self.class_bias)
        return {"gate": self.gate, "class_bias": self.class_bias if known else None, "resolution": self.resolution,
                "systematic": self.systematic, "tokens": self.tokens, "tokens_needed": self.tokens_needed,
                "resolved": self.resolved}


def tokens_needed(class_bias: float, systematic: float, statistical: float, tokens: int) -> int | None:
    """Tokens at which ``systematic + statistical * sqrt(tokens / n)`` falls below ``class_bias`` (both parts
    already times the headroom); None when the systematic part alone reaches it (more tokens cannot help)."""
    room = class_bias - systematic
    if not room > 0.0 or not math.isfinite(statistical) or tokens <= 0:
        return None
    if statistical < room:
        return tokens
    # statistical * sqrt(n / n') < room  <=>  n' > n * (statistical / room)^2; one more than the bound, then
    # past it where float rounding left the bound itself.
    need = math.floor(tokens * (statistical / room) ** 2) + 1
    while systematic + statistical * math.sqrt(tokens / need) >= class_bias:
        need += max(1, need >> 30)
    return need


def power_of(gate: str, class_bias: float, limit: float, systematic: float, headroom: float, tokens: int,
             *, penalised: bool = False) -> Power:
    """:class:`Power` of a gate whose limit is ``limit`` (of which ``systematic``) over ``tokens``."""
    res, sys_part = headroom * limit, headroom * systematic
    need = tokens_needed(class_bias, sys_part, res - sys_part, tokens)
    return Power(gate, class_bias, res, sys_part, tokens, need, penalised)


def power_sentence(p: Power, name: str) -> str:
    """The no-verdict line of a verdict without power: both numbers, and the tokens that would resolve it."""
    res = apart(p.resolution, p.class_bias)
    if p.penalised:
        bias = apart(p.class_bias, p.resolution)
        lead = (f"{name}: |bias| {bias} below resolution {res}: {p.gate} over {p.tokens} tokens could not have failed a "
                f"full-vocabulary trainer that leaves the penalties out (|log S - penalty term| {bias})")
    else:
        bias = apart(-p.class_bias, -p.resolution)
        lead = (f"{name}: bias {bias} below resolution {res}: {p.gate} over {p.tokens} tokens could not have failed a "
                f"full-vocabulary trainer (bias log S {bias})")
    if p.tokens_needed is None:
        return (lead + f"; its systematic part {apart(p.systematic, p.class_bias)} alone reaches "
                f"{'that bias' if p.penalised else '|log S|'}, so no count of tokens would resolve it (a finer dtype "
                f"on either side would)")
    more = max(p.tokens_needed - p.tokens, 1)
    return lead + f"; about {about(more)} more tokens would resolve it"


def about(n: int) -> str:
    """A count rounded up to two significant digits, with thousands separators (an estimate, said as one)."""
    if n < 100:
        return str(n)
    step = 10 ** (len(str(n)) - 2)
    return f"{-(-n // step) * step:,}"


def unassessed_sentence(p: Power, name: str) -> str:
    """The line of a verdict whose power is unknown: the records hold no log S (or, on a penalised scenario, no
    penalty term) to compare the resolution with."""
    if p.penalised:
        return (f"{name}: power not assessed: the records hold no trainer_penalty_term on this penalised scenario (the "
                f"penalties' part of the bias of a full-vocabulary trainer that leaves them out, which may cancel log S "
                f"or add to it), so whether {p.gate} at resolution {p.resolution:.3g} over {p.tokens} tokens could "
                f"fail one is unknown; trainer_penalty_term (with trainer_log_s where filters truncate), or "
                f"--model CKPT give it")
    return (f"{name}: power not assessed: the records hold no log S (the bias of a full-vocabulary trainer), so "
            f"whether {p.gate} at resolution {p.resolution:.3g} over {p.tokens} tokens could fail one is unknown; "
            f"trainer_log_s, or kept sets with trainer_kept_logits and trainer_full_logprobs, or --model CKPT give it")
