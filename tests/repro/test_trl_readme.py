"""The README's TRL example, as written, on the real checkpoint smollm2-135m with TRL's top_p=0.9 and top_k=0.

Before adaptive capture this raised inside ``GRPOTrainer._generate_single_turn`` on the first step
(top_p without top_k on 49,152 tokens was refused). The block runs in a subprocess (TRL's one-process
gloo group and the colocated engine own the process) in a scratch folder; it writes ``out/`` there.
About 4.5 minutes on a loaded 2-core machine (engine start and imports dominate): marked slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

README = Path(__file__).resolve().parents[2] / "docs" / "trl.md"
TIMEOUT_S = 1200


def readme_block() -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"<!-- trl-grpo:start -->\s*```python\n(.*?)```\s*<!-- trl-grpo:end -->", text, re.S)
    assert m, "docs/trl.md has no <!-- trl-grpo:start --> ... <!-- trl-grpo:end --> python block"
    return m.group(1)


def test_readme_trl_example_runs_on_smollm2_with_top_p(smollm2_dir, tmp_path) -> None:
    block = readme_block()
    assert 'resolve_model("smollm2-135m")' in block and "top_p=0.9" in block
    script = block + (
        "\nimport json\n"
        "json.dump({'plans': capture.capture_plans, 'counts': capture.counts, "
        "'diagnosis': report['scenarios'][0]['trainer_under_test']['diagnosis']}, open('result.json', 'w'))\n"
    )
    (tmp_path / "example.py").write_text(script, encoding="utf-8")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert p.returncode == 0, p.stderr[-4000:]
    import json

    res = json.loads((tmp_path / "result.json").read_text())
    [plan] = res["plans"]
    assert plan["adaptive"] and plan["incomplete_positions"] == 0 and plan["resampled_differently"] == 0
    assert plan["largest_support"] > 20  # a real nucleus at T=1, top_p=0.9: tens to thousands of tokens
    assert res["counts"]["incomplete_positions"] == 0 and res["counts"]["sequences"] == 8
    assert "full-vocabulary distribution" in res["diagnosis"]
    assert (tmp_path / "out" / "capture.pt").is_file() and (tmp_path / "out" / "parity" / "report.json").is_file()
