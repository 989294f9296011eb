"""Planted faults near each gate's limit, on records rows (dicts of the records format's columns).

Each case plants a fault at about 3x its gate's limit (the gate must fail) and at about 0.1x (it
must pass), in the gate's own unit: a position's bound for the drift gates, the base analysis' mean
limit for the mean gates, probability mass for the support gate, counts for the count gates. Shared
by the records analysis tests on synthetic logits and the end-to-end tests on the real checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from parity.core.error_model import SUPPORT_MASS_TOL
from parity.core.gates import Thresholds

Rows = list[dict[str, Any]]
Plant = Callable[..., Rows]
# The count gates' limit: 10 positions (30 planted fail it, 1 planted passes).
COUNT_LIMIT = 10
GATES = ("replay_drift", "recompute_drift", "trainer_under_test_drift", "replay_mean_bias", "recompute_mean_bias",
         "trainer_under_test_mean_bias", "naive_vs_sampler_log_s", "replay_support", "recompute_support",
         "incomplete_capture", "sampled_outside", "token_mismatch")


def _copy(rows: Rows) -> Rows:
    return [{k: (list(v) if isinstance(v, list) else v) for k, v in r.items()} for r in rows]


def _bump_bounds(column: str, times: float, where: Sequence[tuple[int, int]], bound=("trainer_bound",)) -> Plant:
    """Move ``column`` away from the sampler by ``times`` the position's bound (the gate's own unit), downwards:
    a log-prob stays <= 0, as records must hold it."""
    def plant(rows: Rows) -> Rows:
        out = _copy(rows)
        for i, t in where:
            r = out[i]
            b = sum(r[c][t] for c in bound)
            r[column][t] = r["sampler_logprobs"][t] + (r[column][t] - r["sampler_logprobs"][t]) - times * b
        return out
    return plant


def _bias(column: str, times: float, limit_key: str) -> Plant:
    """Shift ``column`` at every position down by ``times`` its mean-bias limit (from the base analysis), as a
    trainer biased by log S < 0 is; a log-prob stays <= 0, as records must hold it."""
    def plant(rows: Rows, sc: dict[str, Any]) -> Rows:
        out = _copy(rows)
        delta = -times * sc["mean_bias_limit"][limit_key]
        for r in out:
            r[column] = [v + delta for v in r[column]]
        return out
    return plant


def _naive(times: float, where: tuple[int, int]) -> Plant:
    """Move the naive value outside the sampler-side log S by ``times`` its bound (bound + bound_full)."""
    def plant(rows: Rows) -> Rows:
        out = _copy(rows)
        i, t = where
        r = out[i]
        nb = r["trainer_bound"][t] + r["trainer_bound_full"][t]
        r["trainer_full_logprobs"][t] = r["sampler_logprobs"][t] + r["sampler_log_s_lo"][t] - times * nb
        return out
    return plant


def drop_mass(delta: float, positions: Sequence[tuple[int, int]], n: int = 1) -> Plant:
    """Take ``delta`` of probability from the largest non-sampled kept id at n positions."""
    def plant(rows: Rows) -> Rows:
        out = _copy(rows)
        done = 0
        for i, t in positions:
            r = out[i]
            a, b = r["kept_offsets"][t], r["kept_offsets"][t + 1]
            cands = [j for j in range(a, b) if r["kept_ids"][j] != r["completion_ids"][t] and math.exp(r["kept_logprobs"][j]) > 2 * delta]
            if not cands:
                continue
            j = cands[0]
            r["kept_logprobs"][j] = math.log(math.exp(r["kept_logprobs"][j]) - delta)
            done += 1
            if done == n:
                return out
        raise AssertionError("no position to plant on")
    return plant


def _flag(column: str, n: int, positions: Sequence[tuple[int, int]]) -> Plant:
    def plant(rows: Rows) -> Rows:
        out = _copy(rows)
        for i, t in positions[:n]:
            out[i][column][t] = column == "kept_incomplete"
        return out
    return plant


def _drop_sampled(n: int, positions: Sequence[tuple[int, int]]) -> Plant:
    def plant(rows: Rows) -> Rows:
        out = _copy(rows)
        for i, t in positions[:n]:
            r = out[i]
            a, b = r["kept_offsets"][t], r["kept_offsets"][t + 1]
            j = next(j for j in range(a, b) if r["kept_ids"][j] == r["completion_ids"][t])
            for col in ("kept_ids", "kept_logprobs", "trainer_kept_logits"):
                if r.get(col) is not None:
                    del r[col][j]
            r["kept_offsets"] = r["kept_offsets"][: t + 1] + [o - 1 for o in r["kept_offsets"][t + 1 :]]
        return out
    return plant


def _mismatch(n: int, positions: Sequence[tuple[int, int]], vocab: int) -> Plant:
    def plant(rows: Rows) -> Rows:
        out = _copy(rows)
        for i, t in positions[:n]:
            r = out[i]
            r["trainer_token_ids"] = list(r.get("trainer_token_ids") or r["completion_ids"])
            r["trainer_token_ids"][t] = (r["trainer_token_ids"][t] + 1) % vocab
        return out
    return plant


def cases(positions: Sequence[tuple[int, int]], vocab: int, *, at: tuple[int, int] = (0, 7)) -> dict[str, tuple[Plant, Plant, Thresholds]]:
    """gate -> (planted at ~3x its limit, at ~0.1x, thresholds), for rows whose tokens are ``positions``
    (``(row, position)`` pairs, in file order); ``at`` is the one position the per-token faults move."""
    n = len(positions)
    if n < 4 * COUNT_LIMIT:
        raise ValueError(f"{n} positions: the count gates' faults need at least {4 * COUNT_LIMIT}")
    tol = Thresholds()
    frac = COUNT_LIMIT / n
    big, small = 3 * COUNT_LIMIT, 1
    where = (at,)
    return {
        "replay_drift": (_bump_bounds("trainer_replay_logprobs", 3, where), _bump_bounds("trainer_replay_logprobs", 0.1, where), tol),
        "recompute_drift": (_bump_bounds("trainer_recompute_logprobs", 3, where),
                            _bump_bounds("trainer_recompute_logprobs", 0.1, where), tol),
        "trainer_under_test_drift": (_bump_bounds("trainer_logprobs", 3, where), _bump_bounds("trainer_logprobs", 0.1, where), tol),
        "replay_mean_bias": (_bias("trainer_replay_logprobs", 3, "replay"), _bias("trainer_replay_logprobs", 0.1, "replay"), tol),
        "recompute_mean_bias": (_bias("trainer_recompute_logprobs", 3, "recompute"),
                                _bias("trainer_recompute_logprobs", 0.1, "recompute"), tol),
        "trainer_under_test_mean_bias": (_bias("trainer_logprobs", 3, "trainer_under_test"),
                                         _bias("trainer_logprobs", 0.1, "trainer_under_test"), tol),
        "naive_vs_sampler_log_s": (_naive(3, at), _naive(0.1, at), tol),
        "replay_support": (drop_mass(3 * SUPPORT_MASS_TOL, positions), drop_mass(0.1 * SUPPORT_MASS_TOL, positions), tol),
        "recompute_support": (_flag("trainer_recompute_support_equal", big, positions),
                              _flag("trainer_recompute_support_equal", small, positions),
                              Thresholds(recompute_support_equal_frac=1 - frac)),
        "incomplete_capture": (_flag("kept_incomplete", big, positions), _flag("kept_incomplete", small, positions),
                               Thresholds(max_incomplete_frac=frac)),
        "sampled_outside": (_drop_sampled(big, positions), _drop_sampled(small, positions),
                            Thresholds(max_sampled_outside=COUNT_LIMIT, replay_support_equal_frac=1 - 3 * frac)),
        "token_mismatch": (_mismatch(big, positions, vocab), _mismatch(small, positions, vocab),
                           Thresholds(max_token_mismatch=COUNT_LIMIT)),
    }
