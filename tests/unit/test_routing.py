"""MoE routing gates on arrays (parity.core.routing), the routed-experts records columns and the MoE recipes."""

from __future__ import annotations

import numpy as np
import pytest

from parity.core.routing import (
    margin_bound,
    replay_forced,
    routing_agreement,
    topk_margin,
)
from parity.errors import UsageError
from parity.records.read import open_records
from parity.records.schema import RecordsError
from parity.records.validate import validate_batch
from parity.records.write import records_table, write_records

ROWS, LAYERS, K, E, H = 12, 3, 2, 8, 64


def _case(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 0.25, size=(ROWS, LAYERS, E))
    h_norm = np.full((ROWS, LAYERS), np.sqrt(H))
    w_rms = np.full((LAYERS, E), 0.02)
    margin, pair = topk_margin(logits, K)
    ids = np.argsort(-logits, -1, kind="stable")[..., :K].astype(np.int32)
    return {"logits": logits, "h": h_norm, "w": w_rms, "pair": pair, "margin": margin, "ids": ids,
            "prompt": np.repeat(np.arange(3), ROWS // 3), "position": np.tile(np.arange(ROWS // 3), 3)}


def _plant_flip(c: dict[str, np.ndarray], row: int, layer: int, margin: float, rank: int = K) -> np.ndarray:
    """Put the trainer's expert of ``rank`` (K: the (k+1)-th) ``margin`` below its k-th at (row, layer) and give
    the sampler that expert in place of the k-th."""
    order = np.argsort(-c["logits"][row, layer], kind="stable")
    a, b = order[K - 1], order[rank]
    c["logits"][row, layer, b] = c["logits"][row, layer, a] - margin
    sampler = c["ids"].copy()
    sampler[row, layer][sampler[row, layer] == a] = b
    return sampler


def _agreement(sampler: np.ndarray, case: dict[str, np.ndarray], dtypes: tuple[str, str]):
    return routing_agreement(sampler, case["ids"], case["logits"], case["h"], case["w"], dtypes, case["prompt"],
                             case["position"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_flip_at_a_few_times_the_bound_fails_and_at_a_tenth_passes(dtype: str) -> None:
    c = _case()
    bound = margin_bound(c["h"], c["w"], c["pair"], ("float32", dtype))
    row, layer = 5, 1
    for factor, fails in ((3.0, True), (0.1, False)):
        case = _case()
        sampler = _plant_flip(case, row, layer, factor * float(bound[row, layer]))
        res, (where, detail) = _agreement(sampler, case, ("float32", dtype))
        assert res["flips"] == 1 and res["per_layer"][layer]["flips"] == 1
        assert res["rows_any_layer_differs"] == pytest.approx(1 / ROWS)
        assert res["agreement"] == pytest.approx(1 - 1 / (ROWS * LAYERS))
        assert res["flips_above_bound"] == int(fails) and bool(where) is fails, (factor, where)
        if fails:
            (p,) = where
            assert (p.prompt, p.position) == (int(case["prompt"][row]), int(case["position"][row]))
            assert f"layer {layer}" in p.note and p.gap == pytest.approx(factor * float(bound[row, layer]))
            assert detail.startswith("1 of 1 flips")
        else:
            assert res["flips_within_bound"] == 1 and res["worst_margin_over_bound"] == pytest.approx(0.1, rel=1e-6)


def test_a_flip_to_a_far_expert_is_judged_by_its_own_margin_not_the_kth_gap() -> None:
    """The k-th/(k+1)-th margin is a tenth of the bound, but the sampler took the (k+2)-th, 3 bounds below."""
    case = _case(3)
    row, layer = 2, 0
    order = np.argsort(-case["logits"][row, layer], kind="stable")
    a, b, c = order[K - 1], order[K], order[K + 1]
    bound = margin_bound(case["h"], case["w"], np.array([[[a, c]]]), "bfloat16")[0, 0]
    case["logits"][row, layer, c] = case["logits"][row, layer, a] - 3 * bound
    case["logits"][row, layer, b] = case["logits"][row, layer, a] - 0.1 * bound
    sampler = case["ids"].copy()
    sampler[row, layer][sampler[row, layer] == a] = c
    res, ((p,), _) = _agreement(sampler, case, ("float32", "bfloat16"))
    assert res["flips_above_bound"] == 1 and p.gap == pytest.approx(3 * bound)


def test_identical_routing_agrees_everywhere() -> None:
    c = _case(1)
    res, listed = _agreement(c["ids"][..., ::-1].copy(), c, ("float32", "float32"))  # rank order does not matter
    assert (res["agreement"], res["flips"], listed) == (1.0, 0, ((), ""))


def test_replay_off_by_one_position_fails_naming_the_first_position() -> None:
    c = _case(2)
    ok, none = replay_forced(c["ids"], c["ids"].copy(), c["prompt"], c["position"])
    assert ok.forced_frac == 1.0 and none == ((), "")
    shifted = np.roll(c["ids"], 1, axis=0)
    check, (where, _) = replay_forced(c["ids"], shifted, c["prompt"], c["position"])
    differ = ~(np.sort(c["ids"], -1) == np.sort(shifted, -1)).all(-1)
    assert check.mismatched == int(differ.sum()) > 0
    assert check.forced_frac == pytest.approx(1 - differ.mean())
    r, layer = np.argwhere(differ)[0]
    assert (where[0].prompt, where[0].position) == (int(c["prompt"][r]), int(c["position"][r]))
    assert f"layer {layer}" in where[0].note


def test_shapes_that_do_not_match_are_refused() -> None:
    c = _case()
    with pytest.raises(UsageError, match="allowed the same"):
        routing_agreement(c["ids"][:, :2], c["ids"], c["logits"], c["h"], c["w"], "float32", c["prompt"], c["position"])


# -- records -----------------------------------------------------------------------------------------


def _row(prompt: int = 3, completion: int = 4, layers: int = 2, k: int = 2, experts: int = 8) -> dict[str, object]:
    n = (prompt + completion - 1) * layers * k
    return {"prompt_ids": list(range(prompt)), "completion_ids": list(range(completion)), "temperature": 1.0,
            "top_k": 0, "top_p": 1.0, "min_p": 0.0, "sampler_logprobs": [-1.0] * completion,
            "routed_experts": [i % experts for i in range(n)], "routed_layers": layers, "routed_top_k": k,
            "routed_num_experts": experts}


def test_routed_experts_round_trip(tmp_path) -> None:
    rows = [_row(), _row(prompt=5, completion=2)]
    rows[1]["routed_experts"][0] = -1  # a position no forward ran (a prefix-cache hit)
    write_records(tmp_path / "r.parquet", records_table(rows))
    (batch,) = open_records(tmp_path / "r.parquet").batches()
    assert batch.routed is not None
    rag, shape = batch.routed
    assert shape.tolist() == [[2, 2, 8], [2, 2, 8]]
    assert [rag.row(i).tolist() for i in range(2)] == [r["routed_experts"] for r in rows]


@pytest.mark.parametrize(("edit", "match"), [
    (lambda r: r["routed_experts"].__setitem__(9, 8), r"routed_experts position 2 layer 0: expert id 8: allowed -1 .* < routed_num_experts = 8"),
    (lambda r: r.update(routed_layers=3), r"routed_experts: 24 ids: allowed .* = 6 x 3 x 2 = 36"),
    (lambda r: r.update(routed_num_experts=2), r"routed_num_experts: value 2: allowed an integer > routed_top_k"),
    (lambda r: r.pop("routed_top_k"), r"routed_experts, routed_layers, routed_num_experts without routed_top_k"),
])
def test_bad_routed_experts_are_refused_naming_field_value_and_allowed(edit, match) -> None:
    row = _row()
    edit(row)
    with pytest.raises(RecordsError, match=match):
        validate_batch(records_table([row]), source="f.parquet")


# -- recipes -----------------------------------------------------------------------------------------


def test_moe_recipes_are_checked() -> None:
    from parity.fixtures import load_recipe, recipe_from_dict

    base = {k: v for k, v in vars(load_recipe("qwen3-moe-tiny")).items() if k not in ("name", "tie_groups")}
    assert recipe_from_dict(base, name="ok").num_experts == 8
    with pytest.raises(UsageError, match="num_experts_per_tok=8: allowed num_experts >= 2 and 1 <= num_experts_per_tok < num_experts"):
        recipe_from_dict({**base, "num_experts_per_tok": 8}, name="bad")
    with pytest.raises(UsageError, match="num_experts=8 is invalid for the dense arch 'qwen3'"):
        recipe_from_dict({**base, "arch": "qwen3"}, name="bad")
    with pytest.raises(UsageError, match="missing field 'moe_intermediate_size'"):
        recipe_from_dict({k: v for k, v in base.items() if k != "moe_intermediate_size"}, name="bad")


def test_analysis_of_records_with_routed_experts_says_the_routing_gates_were_not_evaluated(tmp_path) -> None:
    from parity.analyze.report import analyze

    write_records(tmp_path / "r.parquet", records_table([{**_row(), "trainer_logprobs": [-1.0] * 4}]))
    report = analyze(tmp_path / "r.parquet", plots=False)
    assert any("routed_experts is present but the routing gates were not evaluated in 1 scenario" in w
               for w in report["warnings"]), report["warnings"]


def test_batch_invariant_mode_makes_the_moe_trainer_bitwise_across_batches() -> None:
    import torch

    from parity.determinism.knobs import batch_invariant_mode
    from parity.engines.transformers_trainer import TransformersTrainer
    from parity.fixtures import resolve_model

    model = TransformersTrainer(resolve_model("qwen3-moe-tiny")).model
    before = model.config._experts_implementation
    alone = torch.arange(5, 17)[None]
    batch = torch.stack([alone[0], torch.arange(40, 52)])
    with batch_invariant_mode(True, device="cpu", models=[model]) as state, torch.no_grad():
        assert state.to_dict()["knobs"]["trainer_experts"]["status"] == "on"
        assert torch.equal(model(input_ids=alone).logits[0], model(input_ids=batch).logits[0])
    assert model.config._experts_implementation == before


def test_routes_assemble_by_position_from_either_route() -> None:
    from types import SimpleNamespace

    import torch

    from parity.engines.routed_experts import BINDER, NATIVE, ROUTED, assemble, attach_routes

    ids = np.arange(9 * 2 * 2, dtype=np.int32).reshape(9, 2, 2) % 8  # 9 routed positions, 2 layers, top-2
    # The binder's steps: a chunked prefill (positions 0-3, then 4-6), then two decode steps, out of order.
    steps = [(np.arange(4, 7), {0: ids[4:7, 0], 1: ids[4:7, 1]}), (np.arange(0, 4), {0: ids[:4, 0], 1: ids[:4, 1]}),
             (np.array([7]), {0: ids[7:8, 0], 1: ids[7:8, 1]}), (np.array([8]), {0: ids[8:9, 0], 1: ids[8:9, 1]})]
    got, missing = assemble(steps, 9)
    assert missing == 0 and np.array_equal(got, ids)
    got, missing = assemble(steps[1:], 9)  # positions 4-6 never ran a forward (a cache hit)
    assert missing == 3 and (got[4:7] == -1).all() and np.array_equal(got[7:], ids[7:])
    rec = SimpleNamespace(prompt_ids=[1, 2, 3, 4, 5], length=5, extras={})
    native = SimpleNamespace(request_id="0", outputs=[SimpleNamespace(routed_experts=ids[:8])])  # one row short
    facts = attach_routes([rec], [native], None, 8)
    assert facts["route"] == NATIVE and facts["uncovered_rows"] == 1 and (rec.extras[ROUTED][8] == -1).all()
    assert torch.equal(rec.extras[ROUTED][:8], torch.from_numpy(ids[:8]).long())
    facts = attach_routes([rec], [native], {"0": steps}, 8)
    assert facts["route"] == BINDER and facts["uncovered_rows"] == 0 and torch.equal(rec.extras[ROUTED], torch.from_numpy(ids).long())


def test_engine_setting_fields_are_checked_and_chunked_sampling_is_refused_on_cpu(tmp_path) -> None:
    from parity.core.matrix import Matrix, Scenario, load_matrix
    from parity.core.spec import SamplingSpec
    from parity.run import RunConfig, preflight

    bad = tmp_path / "m.toml"
    bad.write_text('[[scenario]]\nname = "x"\ntemperature = 0.0\nmax_num_batched_tokens = 4\n')
    with pytest.raises(UsageError, match="max_num_batched_tokens=4 is invalid: allowed an integer >= 16"):
        load_matrix(bad)
    bad.write_text('[[scenario]]\nname = "x"\ntemperature = 0.0\nprefix_caching = "yes"\n')
    with pytest.raises(UsageError, match="prefix_caching='yes' is invalid: allowed true or false"):
        load_matrix(bad)
    m = Matrix("m", (Scenario("chunked", SamplingSpec(temperature=1.0), max_num_batched_tokens=32),))
    with pytest.raises(UsageError, match="CPU Generator does not use offset.*allowed: temperature 0 on CPU"):
        preflight(m, RunConfig(model="qwen3-moe-tiny"))
    preflight(Matrix("m", (Scenario("greedy", SamplingSpec(temperature=0.0), max_num_batched_tokens=32),)),
              RunConfig(model="qwen3-moe-tiny"))


def test_settings_effect_pairs_each_setting_with_the_same_scenario_without_it() -> None:
    import torch

    from parity.core.matrix import Scenario
    from parity.core.sequence import SequenceRecord
    from parity.core.settings_effect import settings_effect
    from parity.core.spec import SamplingSpec

    greedy = SamplingSpec(temperature=0.0)

    def rec(i: int, tokens: list[int], lps: list[float], routed: list[int]) -> SequenceRecord:
        r = SequenceRecord("vllm", i, [1, 2], tokens, greedy, 0, torch.tensor(lps, dtype=torch.float32))
        r.extras["routed_experts"] = torch.tensor(routed).reshape(-1, 1, 1)  # 3 rows, 1 layer, top-1
        return r

    base = [rec(0, [5, 6], [-1.0, -2.0], [0, 1, 2]), rec(1, [7, 8], [-1.0, -2.0], [0, 1, 2])]
    cached = [rec(0, [5, 6], [-1.0, -2.0], [-1, 1, 2]), rec(1, [7, 9], [-1.0, -2.5], [0, 1, 3])]
    chunked = [rec(0, [5, 6], [-1.0, -2.0 + 1e-6], [0, 1, 2]), rec(1, [7, 8], [-1.0, -2.0], [0, 1, 2])]
    other = [rec(0, [5, 6], [-1.0, -2.0], [0, 1, 2])]
    scenarios = [Scenario("base", greedy, prompts=2), Scenario("cached", greedy, prompts=2, prefix_caching=True),
                 Scenario("chunked", greedy, prompts=2, max_num_batched_tokens=32),
                 Scenario("cold", SamplingSpec(temperature=1.0), prompts=1, prefix_caching=True)]
    got = {e["scenario"]: e for e in settings_effect(scenarios, [base, cached, chunked, other], "m", False)}
    assert set(got) == {"cached", "chunked"}  # "cold" has no scenario without the setting to compare with
    c = got["cached"]
    assert (c["baseline"], c["same_tokens"], c["logprobs_bitwise_equal"], c["routed_rows_compared"]) == ("base", 1, 1, 2)
    h = got["chunked"]
    assert (h["same_tokens"], h["logprobs_bitwise_equal"], h["routed_rows_equal"]) == (2, 1, 6)
    assert h["max_abs_logprob_diff"] == pytest.approx(float(np.float32(-2.0 + 1e-6)) + 2.0)


def _section(flips_above: int = 0, forced: float = 1.0, headroom: float = 0.1) -> dict:
    drift = {"tokens": 8, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "mean_diff": 0.0, "headroom": headroom,
             "is_ratio_token_mean": 1.0, "is_ratio_token_max": 1.0, "is_ratio_seq_min": 1.0, "is_ratio_seq_max": 1.0}
    listed = {"routing_agreement": {"worst": [{"prompt": 1, "position": 7, "note": "layer 2: margin 0.3"}],
                                    "detail": "1 of 3 flips"}} if flips_above else {}
    return {"rows": 16, "layers": 4, "top_k": 2, "num_experts": 8, "per_layer": [], "agreement": 0.99,
            "rows_any_layer_differs": 0.1, "flips": 3, "flips_within_bound": 3 - flips_above,
            "flips_above_bound": flips_above, "worst_margin_over_bound": 0.5, "uncovered_rows": 0,
            "replay": {"rows": 16, "forced_frac": forced, "mismatched": 0, "drift": {"without_replay": drift,
                                                                                     "with_replay": dict(drift)}},
            "listed": listed}


def test_the_routing_entries_fail_a_planted_fault_near_their_limits() -> None:
    """The table's routing rules on a routing section: replay drift at 3x the bound fails, at a tenth passes;
    one flip above the margin bound fails naming its position; a replay that forced 15 of 16 sets fails."""
    from parity.core.gates import Thresholds
    from parity.judge.gate_table import GateCase, evaluate

    def gates(section: dict) -> list:
        return evaluate(GateCase("moe", None, None, Thresholds(), routing=section), "routing")  # type: ignore[arg-type]

    assert gates(_section(headroom=0.1)) == []
    [drift] = gates(_section(headroom=3.0))
    assert drift.gate == "routing_replay_drift" and drift.statistic == 3.0 and drift.limit == 1.0
    [flip] = gates(_section(flips_above=1))
    assert flip.gate == "routing_agreement" and (flip.worst[0].prompt, flip.worst[0].position) == (1, 7)
    [forced] = gates(_section(forced=15 / 16))
    assert forced.gate == "routing_replay_forced" and forced.comparison == "<"
