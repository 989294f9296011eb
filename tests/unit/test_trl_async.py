"""TRL's asynchronous trainer: its own compute_loss on planted inputs, the tree attention substitute, the kept-set
store. No engine; TRL and the qwen2-tiny fixture (built from code) only."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("trl.experimental.async_grpo")

from parity.core.sequence import SequenceRecord  # noqa: E402
from parity.core.spec import SamplingSpec  # noqa: E402
from parity.engines.trl_async import config_defaults, pack, tree_mask, trl_compute_loss  # noqa: E402
from parity.engines.vllm_server.capture_proxy import KeptSets, spec_of_request  # noqa: E402
from parity.errors import UsageError  # noqa: E402

PROMPT = [5, 6, 7]
FULL = -1.0  # the trainer's full-vocabulary log-prob at every trained position (the stub's)


def _samples(log_s: list[list[float]], advantages: list[float]) -> list[SimpleNamespace]:
    """One sample per row: ``old_log_probs`` = the sampler's processed log-prob = FULL - log S per token."""
    out = []
    for i, (row, adv) in enumerate(zip(log_s, advantages, strict=True)):
        comp = [100 + 10 * i + t for t in range(len(row))]  # distinct completions: no shared tree positions
        out.append(SimpleNamespace(
            input_ids=np.array(PROMPT + comp), completion_mask=np.array([0] * len(PROMPT) + [1] * len(row)),
            old_log_probs=np.array([0.0] * len(PROMPT) + [FULL - v for v in row], dtype=np.float32),
            advantage=adv, group_id=0, metrics={}))
    return out


class _Stub:
    """A fused-head policy whose log-prob at every labelled position is FULL."""

    def __call__(self, *, input_ids: torch.Tensor, shift_labels: torch.Tensor, **kw: object) -> SimpleNamespace:
        lp = torch.where(shift_labels != -100, FULL, 0.0).float()
        return SimpleNamespace(log_probs=lp, entropy=torch.zeros_like(lp))


def _trl(log_s: list[list[float]], advantages: list[float]) -> dict[str, float]:
    eps = config_defaults()
    _, metrics = trl_compute_loss(_Stub(), pack(_samples(log_s, advantages), pad_token_id=0),
                                  epsilon=eps["epsilon"], epsilon_high=eps["epsilon_high"])
    return metrics


ADV = [1.0, -1.0, 0.5, -0.5]


def test_defaults_epsilon_and_temperature() -> None:
    d = config_defaults()
    assert d["epsilon"] == 0.2 and d["epsilon_high"] is None and d["temperature"] == 1.0


def test_log_s_at_the_edge_of_epsilon_is_not_clipped_and_the_ratio_is_s() -> None:
    """log S = -0.22 (top_p=0.8's -0.223 rounded up): every ratio is exp(-0.22) = 0.8025 > 1 - 0.2."""
    m = _trl([[-0.22] * 4] * 4, ADV)
    assert m["ratio"] == pytest.approx(math.exp(-0.22), abs=1e-6)
    assert m["kl"] == pytest.approx(math.exp(-0.22) - 1 + 0.22, abs=1e-6)
    assert m["clip_ratio/region_mean"] == 0.0


def test_at_the_edge_rounding_noise_decides_which_tokens_are_clipped() -> None:
    """log S -0.22 +- 0.01 straddles log 0.8 = -0.2231: TRL clips exactly the negative-advantage tokens below it."""
    rng = np.random.default_rng(0)
    log_s = (-0.22 + 0.01 * rng.standard_normal((4, 8))).tolist()
    m = _trl(log_s, ADV)
    below = [[v < math.log(0.8) for v in row] for row in log_s]
    want = sum(b for row, a in zip(below, ADV, strict=True) for b in row if a < 0)
    assert 0 < want < 16  # the plant straddles the edge
    assert round(m["clip_ratio/low_mean"] * 32) == want and m["clip_ratio/high_mean"] == 0.0


def test_top_k_log_s_clips_every_negative_advantage_token() -> None:
    """log S = -1.77 (the report's top_k=50 on a flat policy): ratio 0.17, every A < 0 token clipped, no A > 0 one."""
    m = _trl([[-1.77] * 4] * 4, ADV)
    assert m["ratio"] == pytest.approx(math.exp(-1.77), abs=1e-6)
    assert m["clip_ratio/low_mean"] == 0.5 and m["clip_ratio/high_mean"] == 0.0
    assert m["clip_ratio/region_mean"] == 0.5
    assert m["clip_ratio/low_min"] == 0.0  # the positive-advantage completions have no clipped token
    all_negative = _trl([[-1.77] * 4] * 2, [-1.0, -0.5])
    assert all_negative["clip_ratio/low_min"] == 1.0


def test_a_tenth_of_the_edge_is_not_clipped() -> None:
    """Negative control: log S = -0.022 (a tenth of the edge) clips nothing; ratio exp(-0.022)."""
    m = _trl([[-0.022] * 4] * 4, ADV)
    assert m["ratio"] == pytest.approx(math.exp(-0.022), abs=1e-6) and m["clip_ratio/region_mean"] == 0.0


def test_the_replayed_trainer_has_ratio_one() -> None:
    """log S 0 (the trainer renormalised over S_q): ratio 1, kl 0, nothing clipped, even where S was 0.17."""
    m = _trl([[0.0] * 4] * 4, ADV)
    assert m["ratio"] == 1.0 and m["kl"] == 0.0 and m["clip_ratio/region_mean"] == 0.0


def test_tree_mask_is_ancestors_and_causal() -> None:
    """Two samples sharing a 3-token prefix, packed by TRL's TreeRow: each branch sees the prefix and itself only."""
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for comp in ([1, 2], [3, 4]):
        ids = torch.tensor([9, 8, 7] + comp)
        row.add({"input_ids": ids, "completion_mask": torch.tensor([0, 0, 0, 1, 1]),
                 "old_log_probs": torch.zeros(5), "advantage": 1.0, "group_id": 0, "metrics": {}})
    p = row.pack()
    mask = tree_mask(p["input_ids"].numel(), p["tree_kv_index"], p["tree_cu_seqlens_q"], p["tree_cu_seqlens_k"])
    tokens = p["input_ids"].tolist()
    seen = {tokens[q]: sorted(tokens[k] for k in torch.nonzero(mask[q]).squeeze(1).tolist()) for q in range(len(tokens))}
    assert seen[9] == [9] and seen[7] == [7, 8, 9]
    assert seen[2] == [1, 2, 7, 8, 9] and seen[4] == [3, 4, 7, 8, 9]  # never the other branch


def test_tree_attention_substitute_matches_one_sequence_at_a_time() -> None:
    """The standard-attention tree forward gives each token the log-prob the plain model gives its own sequence."""
    from transformers import AutoModelForCausalLM

    from parity.engines.trl_async import load_policy
    from parity.fixtures import build

    path = build("qwen2-tiny")
    policy = load_policy(path, temperature=1.0)
    plain = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    samples = _samples([[0.0] * 5] * 3, [1.0, -1.0, 0.0])
    for i, s in enumerate(samples):  # share the prompt and the first completion token across samples
        s.input_ids = np.array(PROMPT + [50] + [60 + 7 * i + t for t in range(4)])
    inputs = pack(samples, pad_token_id=0)
    sel = inputs["token_index"][0] >= 0
    with torch.no_grad():
        out = policy(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"],
                     shift_labels=inputs["shift_labels"], fused_lm_head=True,
                     **{k: inputs[k][inputs[k] >= 0] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")},
                     tree_max_seqlen_q=0, tree_max_seqlen_k=0)
        tree_lp = out.log_probs.flatten()[inputs["token_index"][0][sel]]
        want = []
        for s in samples:
            ids = torch.tensor(s.input_ids).unsqueeze(0)
            lp = torch.log_softmax(plain(input_ids=ids).logits[0, :-1].float(), dim=-1)
            want.append(lp.gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)[len(PROMPT) - 1:])
    assert torch.allclose(tree_lp, torch.cat(want), atol=2e-5, rtol=0)


def _record(completion: list[int], kept: list[list[int]]) -> SequenceRecord:
    width = max(len(k) for k in kept)
    ids = torch.tensor([k + [-1] * (width - len(k)) for k in kept])
    return SequenceRecord(source="vllm-server", prompt_index=0, prompt_ids=PROMPT, completion_ids=completion,
                          spec=SamplingSpec(top_k=2), seed=0, logprobs=torch.zeros(len(completion)), kept_ids=ids,
                          incomplete=torch.zeros(len(completion), dtype=torch.bool))


def test_kept_sets_by_prefix_and_the_wrong_step_plant() -> None:
    rec = _record([11, 12, 13], [[11, 1], [12, 2], [13, 3]])
    right, wrong = KeptSets(), KeptSets(shift=1)
    right.add(rec)
    wrong.add(rec)
    assert right.lookup(PROMPT) == (11, 1) and right.lookup(PROMPT + [11, 12]) == (13, 3)
    assert wrong.lookup(PROMPT + [11, 12]) == (12, 2)  # the previous step's set
    with pytest.raises(KeyError, match="no kept set"):
        right.lookup([1, 2])
    with pytest.raises(UsageError, match="shift=-1"):
        KeptSets(shift=-1)


def test_request_spec_refuses_penalties() -> None:
    body = {"temperature": 1.0, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.0}
    assert spec_of_request(body) == SamplingSpec(top_p=0.9)
    assert spec_of_request({**body, "min_p": 0.1}).min_p == 0.1
    with pytest.raises(UsageError, match="repetition_penalty=1.1"):
        spec_of_request({**body, "repetition_penalty": 1.1})


def test_tree_mask_matches_its_definition_on_random_trees() -> None:
    """Query j of a segment sees the first offset + j + 1 keys of its path (offset: path length - queries), nothing
    else: checked position by position on random trees of up to six segments."""
    import random

    rng = random.Random(0)
    for _ in range(100):
        n, kv, cq, ck, paths = 0, [], [0], [0], []
        for _ in range(rng.randint(1, 6)):
            own = list(range(n, n + rng.randint(1, 8)))
            n += len(own)
            path = sorted(rng.sample(range(own[0]), rng.randint(0, own[0]))) + own
            kv += path
            cq.append(n)
            ck.append(len(kv))
            paths.append((own, path))
        mask = tree_mask(n, torch.tensor(kv), torch.tensor(cq), torch.tensor(ck))
        for own, path in paths:
            for j, q in enumerate(own):
                seen = set(path[: len(path) - len(own) + j + 1])
                assert [k for k in range(n) if mask[q, k]] == sorted(seen)
