"""The budget's math on columns built by hand: the measures by their definitions, attribution of a planted cause
against its noise, order dependence, and the rows of causes that do not apply."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from parity.core.budget import (
    CAUSES,
    HEADLINE,
    PPO_INTERVAL,
    Cause,
    Row,
    Stage,
    Waterfall,
    check_order,
    measures,
    order_notes,
    waterfall,
)
from parity.errors import UsageError

LENGTHS = (12, 9, 16, 5, 14, 10, 16, 7, 11, 13, 8, 15)


def _base(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    sampler = -torch.rand(n, generator=g, dtype=torch.float64) * 3.0
    drift = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3  # the remainder: a symmetric spread
    return sampler, sampler + drift


def _per_sequence_offsets(mean: float, sd: float) -> torch.Tensor:
    """Per token, its sequence's offset ``mean + sd * g`` with the g centred over tokens (their token-weighted mean
    is 0, so the offsets' mean over tokens is ``mean`` exactly)."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(len(LENGTHS), generator=g, dtype=torch.float64)
    n = torch.tensor(LENGTHS, dtype=torch.float64)
    z = z - (z * n).sum() / n.sum()
    return torch.repeat_interleave(mean + sd * z, n.long())


def _only(applies: dict[str, Cause]) -> dict[str, Cause]:
    return {c: applies.get(c, Cause("not_applicable", "not in this setup")) for c in CAUSES}


def test_measures_follow_their_definitions() -> None:
    sampler, trainer = _base()
    trainer = trainer + torch.linspace(-0.4, 0.3, trainer.numel(), dtype=torch.float64)  # some ratios leave [0.8, 1.2]
    got = measures(Stage(trainer, sampler, LENGTHS))
    d = trainer - sampler
    lo, hi = PPO_INTERVAL
    seq = torch.stack([x.sum() for x in torch.split(d, list(LENGTHS))])
    want = {"mean_delta": float(d.mean()), "mean_abs_delta": float(d.abs().mean()),
            "k3_kl": float((d.exp() - 1 - d).mean()),
            "outside_ppo": float(((d.exp() < lo) | (d.exp() > hi)).double().mean()),
            "seq_ratio_sd": float(seq.exp().std())}
    assert 0 < want["outside_ppo"] < 1
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k


def _planted(mean: float, sd: float = 0.02) -> Waterfall:
    """Batch composition as the one cause: the trainer in its batch adds per-sequence offsets."""
    sampler, trainer = _base()
    fault = _per_sequence_offsets(mean, sd)

    def stage(fixed: frozenset[str]) -> Stage:
        t = trainer if "batch_composition" in fixed else trainer + fault
        return Stage(t, sampler, LENGTHS)

    return waterfall(stage, _only({"batch_composition": Cause()}))


def _row(wf: Waterfall, cause: str) -> Row:
    return next(r for r in wf.rows if r.cause == cause)


def test_a_planted_shift_at_three_times_its_noise_is_attributed_and_at_a_third_is_within_noise() -> None:
    # The noise of the mean-δ drop does not depend on the planted mean (a shift of every replicate), so one run
    # without it measures it.
    noise = _row(_planted(0.0), "batch_composition").noise["mean_delta"]
    assert noise and noise > 0
    big = _planted(3 * noise)
    row = _row(big, "batch_composition")
    assert row.drop["mean_delta"] == pytest.approx(3 * noise, rel=1e-6)
    assert not row.within_noise["mean_delta"]
    assert big.largest_fixable("mean_delta").cause == "batch_composition"
    small = _row(_planted(0.3 * noise), "batch_composition")
    assert small.noise["mean_delta"] == pytest.approx(noise, rel=1e-9)
    assert small.within_noise["mean_delta"]
    assert _planted(0.3 * noise).largest_fixable("mean_delta") is None


def test_shares_and_remainder_add_up_to_the_start() -> None:
    sampler, trainer = _base()
    shift = torch.full_like(trainer, -0.1)  # a log S of -0.1 per token: truncation

    def stage(fixed: frozenset[str]) -> Stage:
        return Stage(trainer if "truncation" in fixed else trainer + shift, sampler, LENGTHS)

    wf = waterfall(stage, _only({"truncation": Cause(), "filter_boundary": Cause()}))
    total = sum(r.share[HEADLINE] or 0.0 for r in wf.rows) + (wf.remainder_share[HEADLINE] or 0.0)
    assert total == pytest.approx(1.0, rel=1e-12)
    assert wf.largest_fixable().cause == "truncation"
    assert wf.fix_first().startswith("fix first: truncation normalisation (")
    assert wf.fix_first().endswith("of mean |δ|; replay)")
    boundary = _row(wf, "filter_boundary")
    assert boundary.drop[HEADLINE] == 0.0 and boundary.within_noise[HEADLINE]
    na = _row(wf, "moe_routing")
    assert na.status == "not_applicable" and na.reason and na.share[HEADLINE] == 0.0


def test_a_cause_that_acts_only_after_another_makes_the_shares_depend_on_the_order() -> None:
    sampler, trainer = _base()
    g = torch.Generator().manual_seed(3)
    boundary = torch.randn(trainer.numel(), generator=g, dtype=torch.float64) * 0.05

    def stage(fixed: frozenset[str]) -> Stage:
        # The boundary's error only exists once the trainer renormalises (recompute), as in the real pipeline.
        t = trainer - 0.1 if "truncation" not in fixed else trainer + (0 if "filter_boundary" in fixed else boundary)
        return Stage(t, sampler, LENGTHS)

    causes = _only({"truncation": Cause(), "filter_boundary": Cause()})
    a = waterfall(stage, causes)
    b = waterfall(stage, causes, ("filter_boundary", "truncation"))
    assert _row(b, "filter_boundary").drop[HEADLINE] == 0.0
    assert _row(a, "filter_boundary").share[HEADLINE] > 0.1
    notes = order_notes(a, b)
    assert any(n.startswith("filter boundary:") for n in notes), notes
    assert order_notes(a, a) == []


def test_the_same_columns_give_the_same_shares_and_noise() -> None:
    one, two = _planted(0.01), _planted(0.01)
    assert [r.to_json() for r in one.rows] == [r.to_json() for r in two.rows]


def test_bad_orders_and_causes_are_refused_with_what_is_allowed() -> None:
    with pytest.raises(UsageError, match="'nope'.*allowed truncation"):
        check_order(["nope"])
    with pytest.raises(UsageError, match="twice"):
        check_order(["truncation", "truncation"])
    assert check_order(["sampler_precision"])[:2] == ("sampler_precision", "truncation")
    with pytest.raises(UsageError, match="needs a reason"):
        Cause("not_applicable")
    with pytest.raises(UsageError, match="allowed measured"):
        Cause("maybe", "x")


def test_nan_columns_are_refused() -> None:
    sampler, trainer = _base()
    trainer[3] = math.nan
    with pytest.raises(UsageError, match="NaN"):
        measures(Stage(trainer, sampler, LENGTHS))


def test_an_unknown_cause_in_order_is_a_one_line_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from parity.cli.main import main

    assert main(["budget", "--order", "truncation,nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--order names 'nope': allowed truncation, filter_boundary" in err


def test_budget_takes_runs_shared_options_and_refuses_the_run_only_ones(capsys: pytest.CaptureFixture[str]) -> None:
    from parity.cli.main import build_parser
    from parity.cli.run import config_from_args

    parser = build_parser(load=["budget", "run"])
    args = parser.parse_args(["budget", "--dtype", "bfloat16", "--prompts", "3", "--gate", "max_headroom=2"])
    cfg = config_from_args(args)  # the run-only options hold the budget's defaults
    assert (cfg.dtype, cfg.prompts, str(cfg.out)) == ("bfloat16", 3, "reports/budget")
    assert (args.invariance, args.plant, args.no_sampler_log_s, args.server, args.capture, args.records) == (
        False, None, True, None, "topk", None)
    assert parser.parse_args(["run"]).no_sampler_log_s is False  # a run's own default is untouched
    for only_run in (["--plant", "bias"], ["--invariance"], ["--records", "r.parquet"], ["--server", "spawn"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["budget", *only_run])
        assert "unrecognized arguments" in capsys.readouterr().err
