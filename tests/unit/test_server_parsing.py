"""Server mode, pure parts: parsing /v1/completions answers and detecting faults on canned JSON.

The canned payloads have the shape vLLM 0.32's completion endpoint produces with
``return_tokens_as_token_ids`` (checked against a live server in tests/e2e/test_server.py).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from parity.core.capture import support_from_heads
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.engines.vllm_server.client import _normalise_url
from parity.engines.vllm_server.protocol import (
    LogprobsModeMismatch,
    MalformedResponse,
    check_probe,
    check_processed,
    parse_completion,
)

V = 8
URL = "http://127.0.0.1:9"


def payload(tokens, token_lps, tops, finish="length"):
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "",
                "logprobs": {
                    "text_offset": list(range(len(tokens))),
                    "token_logprobs": token_lps,
                    "tokens": [f"token_id:{t}" for t in tokens],
                    "top_logprobs": [{f"token_id:{k}": v for k, v in top} for top in tops],
                },
                "finish_reason": finish,
            }
        ],
    }


def processed_topk3():
    """top_k=2 processed, logprobs=3: two kept tokens per position, the third entry -inf (sent as -9999.0).

    Each position's dict starts with the sampled token, then the top-3 (the sampled one not repeated).
    """
    return payload(
        [4, 1],
        [math.log(0.7), math.log(0.4)],
        [
            [(4, math.log(0.7)), (1, math.log(0.3)), (0, -9999.0)],
            [(1, math.log(0.4)), (5, math.log(0.6)), (3, -9999.0)],
        ],
    )


def test_parse_recovers_top_k_heads_and_infinities() -> None:
    p = parse_completion(processed_topk3(), max_tokens=2, requested=3, vocab_size=V)
    assert p.completion_ids == [4, 1]
    assert p.head_ids == [[4, 1, 0], [1, 5, 3]]  # K entries: the sampled token is one of them
    assert p.head_logprobs[0][2] == float("-inf")
    cap = support_from_heads(p.completion_ids, p.head_ids, p.head_logprobs, requested=3, vocab_size=V)
    assert cap.incomplete.tolist() == [False, False]
    assert cap.sampled_missing.tolist() == [False, False]
    assert sorted(cap.kept_ids[1].tolist()) == [1, 5]


def test_sampled_token_outside_the_head_is_dropped_from_it() -> None:
    """K + 1 entries: a support of 3 captured with K=2; the sampled token (2) is not in the top-2."""
    d = payload([2], [math.log(0.2)], [[(2, math.log(0.2)), (5, math.log(0.5)), (3, math.log(0.3))]])
    p = parse_completion(d, max_tokens=1, requested=2, vocab_size=V)
    assert p.head_ids == [[5, 3]]
    cap = support_from_heads(p.completion_ids, p.head_ids, p.head_logprobs, requested=2, vocab_size=V)
    assert cap.incomplete.tolist() == [True] and cap.sampled_missing.tolist() == [True]
    check_processed(cap.kept_logprobs, cap.incomplete, url=URL, where="x")  # incomplete: mass not judged


def test_full_vocabulary_and_sampled_only() -> None:
    lps = torch.log_softmax(torch.arange(V, dtype=torch.float64), 0).tolist()
    full = payload([7], [lps[7]], [[(7, lps[7])] + [(i, lps[i]) for i in range(V) if i != 7]])
    p = parse_completion(full, max_tokens=1, requested=-1, vocab_size=V)
    assert sorted(p.head_ids[0]) == list(range(V))
    only = payload([3], [-1.0], [[(3, -1.0)]])
    assert parse_completion(only, max_tokens=1, requested=0, vocab_size=V).head_ids == [[]]


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("choices"), "'choices' has no entries"),
        (lambda d: d["choices"].append(d["choices"][0]), "exactly one completion"),
        (lambda d: d["choices"][0].__setitem__("logprobs", None), "returned no log-probs"),
        (
            lambda d: d["choices"][0]["logprobs"]["tokens"].__setitem__(0, "hello"),
            "return_tokens_as_token_ids",
        ),
        (lambda d: d["choices"][0]["logprobs"]["tokens"].__setitem__(0, "token_id:x"), "no integer id"),
        (lambda d: d["choices"][0]["logprobs"]["tokens"].pop(), "disagree in length"),
        (lambda d: d["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, None), "null"),
        (lambda d: d["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, "x"), "not a number"),
        (lambda d: d["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, float("nan")), "NaN"),
        (lambda d: d["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, -0.5), "top_logprobs says"),
        (
            lambda d: d["choices"][0]["logprobs"]["top_logprobs"][0].pop("token_id:4"),
            "missing from top_logprobs",
        ),
        (
            lambda d: d["choices"][0]["logprobs"]["top_logprobs"][0].__setitem__("token_id:99", -1.0),
            "outside the vocabulary",
        ),
        (lambda d: d["choices"][0]["logprobs"]["top_logprobs"][1].pop("token_id:3"), "allowed 3 or 4"),
        (lambda d: d["choices"][0]["logprobs"]["top_logprobs"].__setitem__(0, [1, 2]), "allowed an object"),
    ],
    ids=[
        "no-choices",
        "two-choices",
        "no-logprobs",
        "text-tokens",
        "bad-id",
        "ragged",
        "null-logprob",
        "string-logprob",
        "nan",
        "inconsistent",
        "sampled-missing",
        "id-out-of-vocab",
        "short-head",
        "head-not-dict",
    ],
)
def test_malformed_responses_name_the_problem(mutate, match) -> None:
    d = processed_topk3()
    mutate(d)
    with pytest.raises(MalformedResponse, match=match):
        parse_completion(d, max_tokens=2, requested=3, vocab_size=V, where="prompt 0")


def test_malformed_body_and_wrong_length() -> None:
    with pytest.raises(MalformedResponse, match="allowed a JSON object"):
        parse_completion([1, 2], max_tokens=2, requested=3, vocab_size=V)
    with pytest.raises(MalformedResponse, match="error"):
        parse_completion({"error": {"message": "boom"}}, max_tokens=2, requested=3, vocab_size=V)
    with pytest.raises(MalformedResponse, match="2 tokens returned, 5 requested"):
        parse_completion(processed_topk3(), max_tokens=5, requested=3, vocab_size=V)
    # NaN arrives as a JSON literal Python accepts: still refused.
    d = json.loads(json.dumps(processed_topk3()).replace("-9999.0", "NaN", 1))
    with pytest.raises(MalformedResponse, match="NaN"):
        parse_completion(d, max_tokens=2, requested=3, vocab_size=V)


def test_processed_heads_pass_the_mass_check() -> None:
    p = parse_completion(processed_topk3(), max_tokens=2, requested=3, vocab_size=V)
    cap = support_from_heads(p.completion_ids, p.head_ids, p.head_logprobs, requested=3, vocab_size=V)
    check_processed(cap.kept_logprobs, cap.incomplete, url=URL, where="prompt 0")


def test_raw_logprobs_are_detected_by_mass() -> None:
    """A raw-mode server with a full-vocabulary head whose top-4 happens to be all it sent (K=4 < V=8)."""
    raw = torch.log_softmax(torch.tensor([3.0, 2.0, 1.5, 1.0, 0.0, -1.0, -2.0, -3.0], dtype=torch.float64), 0)
    heads = [[0, 1, 2, 3]]
    vals = [[raw[i].item() for i in heads[0]]]
    # Complete capture (raw values never are -inf, but a full-vocab request makes the head complete):
    full_heads = [list(range(V))]
    full_vals = [raw.tolist()]
    cap = support_from_heads([0], full_heads, full_vals, requested=-1, vocab_size=V)
    check_processed(
        cap.kept_logprobs, cap.incomplete, url=URL, where="x"
    )  # sums to 1: mass alone cannot tell
    # With top_k=3 and a K=top_k+1 head, raw mode fills the head; drop one to mimic a processed head
    # that claims completeness but carries raw values:
    cap = support_from_heads([0], heads, [vals[0][:3] + [float("-inf")]], requested=4, vocab_size=V)
    with pytest.raises(LogprobsModeMismatch, match="raw_logprobs") as exc:
        check_processed(cap.kept_logprobs, cap.incomplete, url=URL, where="prompt 0")
    assert "--logprobs-mode processed_logprobs" in str(exc.value) and URL in str(exc.value)
    assert "sum to probability 0.88" in str(exc.value)


def test_probe_accepts_processed_and_refuses_raw_and_logits() -> None:
    processed = payload([4, 4], [0.0, 0.0], [[(4, 0.0), (1, -9999.0)], [(4, 0.0), (2, -9999.0)]])
    check_probe(processed, url=URL, vocab_size=V, max_tokens=2)
    tie = payload([4], [math.log(0.5)], [[(4, math.log(0.5)), (1, math.log(0.5))]])
    check_probe(tie, url=URL, vocab_size=V, max_tokens=1)
    raw = payload([4], [-0.4], [[(4, -0.4), (1, -1.5)]])
    with pytest.raises(LogprobsModeMismatch, match="raw_logprobs"):
        check_probe(raw, url=URL, vocab_size=V, max_tokens=1)
    # A peaked raw distribution: mass ~1 but two finite, unequal entries.
    peaked = payload([4], [-1e-9], [[(4, -1e-9), (1, -21.0)]])
    with pytest.raises(LogprobsModeMismatch, match="probe"):
        check_probe(peaked, url=URL, vocab_size=V, max_tokens=1)
    logits = payload([4], [3.2], [[(4, 3.2), (1, -9999.0)]])  # processed_logits: one finite value, not 0
    with pytest.raises(LogprobsModeMismatch, match="probability mass"):
        check_probe(logits, url=URL, vocab_size=V, max_tokens=1)


def test_url_normalisation() -> None:
    assert _normalise_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert _normalise_url("https://host:1/prefix") == "https://host:1/prefix"
    for bad in ("127.0.0.1:8000", "ftp://x", "http://"):
        with pytest.raises(ValueError, match="spawn"):
            _normalise_url(bad)


def _rec(source, ids, lps, kept=None, kept_lp=None, seed=1):
    return SequenceRecord(
        source=source,
        prompt_index=0,
        prompt_ids=[1, 2],
        completion_ids=ids,
        spec=SamplingSpec(0.7, 2),
        seed=seed,
        logprobs=torch.tensor(lps),
        kept_ids=kept,
        kept_logprobs=kept_lp,
    )


RAW = torch.log_softmax(torch.tensor([3.0, 2.0, 1.5, 1.0, 0.0, -1.0, -2.0, -3.0], dtype=torch.float64), 0)


def test_raw_top_k_head_is_detected_by_its_untied_tail() -> None:
    """raw_logprobs never sends -inf: a top_k=2 capture with K=4 comes back full, its tail not tied."""
    spec = SamplingSpec(0.7, top_k=2)
    cap = support_from_heads([0], [[0, 1, 2, 3]], [RAW[:4].tolist()], requested=4, vocab_size=V)
    assert cap.incomplete.tolist() == [True]
    with pytest.raises(LogprobsModeMismatch, match="top_k=2 cannot keep") as exc:
        check_processed(cap.kept_logprobs, cap.incomplete, url=URL, where="p", spec=spec, vocab_size=V)
    assert "raw_logprobs" in str(exc.value)
    # Processed with a 4-way tie at the 2nd value: a full head, legitimately.
    tied = torch.log(torch.tensor([0.4, 0.15, 0.15, 0.15, 0.15], dtype=torch.float64))
    cap = support_from_heads([0], [[0, 1, 2, 3]], [tied[:4].tolist()], requested=4, vocab_size=V)
    check_processed(cap.kept_logprobs, cap.incomplete, url=URL, where="p", spec=spec, vocab_size=V)


def test_raw_full_vocabulary_is_detected_by_min_p_and_top_p() -> None:
    cap = support_from_heads([0], [list(range(V))], [RAW.tolist()], requested=-1, vocab_size=V)
    check_processed(cap.kept_logprobs, cap.incomplete, url=URL, where="p")  # mass is 1: not enough alone
    with pytest.raises(LogprobsModeMismatch, match="min_p=0.1"):
        check_processed(
            cap.kept_logprobs,
            cap.incomplete,
            url=URL,
            where="p",
            spec=SamplingSpec(1.0, min_p=0.1),
            vocab_size=V,
        )
    with pytest.raises(LogprobsModeMismatch, match="top_p=0.9 drops"):
        check_processed(
            cap.kept_logprobs,
            cap.incomplete,
            url=URL,
            where="p",
            spec=SamplingSpec(1.0, top_p=0.9),
            vocab_size=V,
        )
    # The processed answer for top_p=0.9 on the same logits: the tail is -inf, the rest renormalised.
    p = RAW.exp()
    order = torch.argsort(p)
    drop = torch.cumsum(p[order], 0) <= 0.1
    kept = torch.ones(V, dtype=torch.bool)
    kept[order[drop]] = False
    proc = torch.where(
        kept, RAW - torch.logsumexp(RAW[kept], 0), torch.tensor(float("-inf"), dtype=torch.float64)
    )
    cap = support_from_heads([0], [list(range(V))], [proc.tolist()], requested=-1, vocab_size=V)
    check_processed(
        cap.kept_logprobs, cap.incomplete, url=URL, where="p", spec=SamplingSpec(1.0, top_p=0.9), vocab_size=V
    )


def test_native_capture_is_refused_in_server_mode() -> None:
    from parity.engines.vllm_server.client import ServerRollout

    with pytest.raises(ValueError, match="return_sampling_mask"):
        ServerRollout("/nonexistent", server="http://127.0.0.1:9", capture="native")
