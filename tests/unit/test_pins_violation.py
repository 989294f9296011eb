"""Violation and Position pinned exactly: the rendered message and the JSON object, field by field."""

from __future__ import annotations

import json
import math

from parity.core.violation import Position, Violation


def test_position_renders_every_part_in_order() -> None:
    p = Position(prompt=2, position=7, token=41, values={"vllm": -1.25, "trainer": -1.250004}, gap=3.2e-7,
                 bound=1.5e-7, note="sampled 40")
    assert p.where() == "prompt 2, position 7, token 41"
    assert p.render() == "prompt 2, position 7, token 41: vllm=-1.25 trainer=-1.250004 gap=3.2e-07 bound=1.5e-07 (sampled 40)"


def test_position_render_without_locators_or_values() -> None:
    assert Position().where() == "" and Position().render() == ""
    assert Position(values={"a": 0.5}).render() == "a=0.5"
    assert Position(position=0, values={"a": 0.5, "b": 1.0}).render() == "position 0: a=0.5 b=1"
    assert Position(token=3).render() == "token 3"
    assert Position(token=3, note="x").render() == "token 3 (x)"
    assert Position(note="only").render() == " (only)"
    assert Position(gap=2.0).render() == " gap=2"
    assert Position(prompt=0, token=0).where() == "prompt 0, token 0"


def test_position_to_dict_is_json_safe() -> None:
    p = Position(prompt=1, position=2, token=3, values={"vllm": -math.inf, "trainer": -0.5}, gap=math.nan,
                 bound=math.inf, note="n")
    d = p.to_dict()
    assert d == {
        "prompt": 1,
        "position": 2,
        "token": 3,
        "values": {"vllm": "-inf", "trainer": -0.5},
        "gap": "nan",
        "bound": "inf",
        "note": "n",
    }
    assert list(d["values"]) == ["vllm", "trainer"]  # sampler first, as given
    json.dumps(d, allow_nan=False)
    assert Position().to_dict() == {"prompt": None, "position": None, "token": None, "values": {}, "gap": None,
                                    "bound": None, "note": ""}
    assert Position(gap=1, bound=0.25).to_dict()["gap"] == 1.0 and type(Position(gap=1).to_dict()["gap"]) is float


def test_violation_message_and_dict() -> None:
    worst = (Position(prompt=0, position=1, token=2, values={"vllm": -1.0}), Position(token=9))
    v = Violation("replay_drift", "T=0.7 top_k=10", 4.123456, 1.0, "replay max |diff| / bound", worst=worst,
                  detail="two tokens")
    msg = "[T=0.7 top_k=10] replay max |diff| / bound 4.123 > 1: two tokens; worst: prompt 0, position 1, token 2: vllm=-1; token 9"
    assert v.message() == msg and str(v) == msg
    assert v.to_dict() == {
        "gate": "replay_drift",
        "scenario": "T=0.7 top_k=10",
        "statistic": 4.123456,
        "limit": 1.0,
        "label": "replay max |diff| / bound",
        "comparison": ">",
        "worst": [worst[0].to_dict(), worst[1].to_dict()],
        "detail": "two tokens",
        "message": msg,
    }


def test_violation_without_detail_or_worst_and_a_less_than_gate() -> None:
    v = Violation("replay_support", "s", 0.5, 1.0, "replay support equality", "<")
    assert v.message() == "[s] replay support equality 0.5 < 1"
    d = v.to_dict()
    assert d["worst"] == [] and d["detail"] == "" and d["comparison"] == "<"
    inf = Violation("g", "s", math.inf, 0.0, "x").to_dict()
    assert inf["statistic"] == "inf" and inf["limit"] == 0.0
    json.dumps(inf, allow_nan=False)
