"""Scenario matrices: the default covers every filter level; TOML files are validated field by field."""

from __future__ import annotations

import pytest

from parity.core.matrix import FACTORS, default_matrix, load_matrix, pair_coverage


def test_default_matrix_has_every_level_of_every_filter() -> None:
    m = default_matrix()
    levels = {name: {f(s.spec) for s in m.scenarios} for name, f in FACTORS.items()}
    assert {"0", "<1", "1", ">1"} <= levels["temperature"]
    assert {"1", "0.95", "0.9", "0.8", "0.05"} <= levels["top_p"]
    assert {"off", "1", "20", "50", ">=V"} <= levels["top_k"]
    assert {"0", "0.05", "0.1"} <= levels["min_p"]
    assert any(s.spec.uses_top_k and s.spec.uses_top_p and s.spec.uses_min_p for s in m.scenarios)
    assert any(s.model and "ties" in s.model for s in m.scenarios)
    assert {"off", "on"} <= levels["penalties"]
    assert any(s.spec.repetition_penalty != 1.0 and s.spec.uses_top_p for s in m.scenarios)
    assert any(s.spec.presence_penalty and s.spec.frequency_penalty for s in m.scenarios)
    cov = pair_coverage(m)
    assert "20/0.9" in cov["top_k x top_p"]


def test_matrix_file_errors_name_the_field(tmp_path) -> None:
    f = tmp_path / "m.toml"
    f.write_text('[[scenario]]\nname = "a"\ntop_k = 5\nbogus = 1\n')
    with pytest.raises(ValueError, match="unknown key.*bogus"):
        load_matrix(f)
    f.write_text('[[scenario]]\nname = "a"\ntemperature = -1\n')
    with pytest.raises(ValueError, match="temperature=-1"):
        load_matrix(f)
    f.write_text('[[scenario]]\nname = "a"\n[[scenario]]\nname = "a"\n')
    with pytest.raises(ValueError, match="used twice"):
        load_matrix(f)
    f.write_text('[defaults]\nprompts = 0\n[[scenario]]\nname = "a"\n')
    with pytest.raises(ValueError, match="prompts=0"):
        load_matrix(f)
    with pytest.raises(FileNotFoundError):
        load_matrix(tmp_path / "missing.toml")
    f.write_text('[defaults]\nprompts = 2\n[[scenario]]\nname = "a"\ntop_p = 0.9\nmodel = "qwen2-tiny-ties"\n')
    m = load_matrix(f)
    assert m.scenarios[0].prompts == 2 and m.scenarios[0].model == "qwen2-tiny-ties"
