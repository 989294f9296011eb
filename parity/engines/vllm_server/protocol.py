"""The wire format of vLLM's OpenAI-compatible server: parsing and checking completions (pure), and its
errors. The answer's layout (vLLM 0.32): docs/capture_plan.md, section 1."""

from __future__ import annotations

import math

import torch

from parity.core.capture import FULL_VOCAB, Heads, support_mass
from parity.core.spec import SamplingSpec
from parity.errors import EngineError

SOURCE = "vllm-server"
# vLLM serialises -inf as this value (``max(logprob, -9999.0)`` in the completion serving code).
JSON_NEG_INF = -9999.0
TOKEN_PREFIX = "token_id:"
# |mass - 1| above this over a complete kept set means the values are not processed log-probs.
MASS_TOLERANCE = 1e-3
EXPECTED_MODE = "processed_logprobs"
PROBE_SENTENCE = "The sampler and the trainer must agree"


class ServerError(EngineError):
    """Any failure of the server path; the message names the URL and the cause."""


class ServerUnreachable(ServerError):
    """Nothing answers at the URL (closed port, wrong host)."""


class ServerDied(ServerError):
    """The server stopped answering (or its process exited) during a run."""


class MalformedResponse(ServerError):
    """The server answered, but not with what the harness asked for."""


class LogprobsModeMismatch(ServerError):
    """The server's log-probs are not processed log-probs (raw_logprobs or a logits mode)."""


def _mode_hint(url: str) -> str:
    return (
        f"the server at {url} was most likely launched with --logprobs-mode raw_logprobs (vLLM's default) "
        f"or a logits mode; parity compares against what the sampler kept and needs the server started "
        f"with --logprobs-mode {EXPECTED_MODE}")


# -- parsing (pure: canned JSON in, lists out) ------------------------------------------------------


def _token_id(key: object, where: str) -> int:
    if not isinstance(key, str) or not key.startswith(TOKEN_PREFIX):
        raise MalformedResponse(
            f"{where}: token {key!r} is not of the form 'token_id:N' — the server ignored "
            f"return_tokens_as_token_ids (an OpenAI-compatible server that is not vLLM?)")
    try:
        tid = int(key[len(TOKEN_PREFIX) :])
    except ValueError:
        raise MalformedResponse(f"{where}: token {key!r} has no integer id after 'token_id:'") from None
    if tid < 0:
        raise MalformedResponse(f"{where}: token id {tid} is negative")
    return tid


def _logprob(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedResponse(f"{where}: log-prob {value!r} is not a number")
    v = float(value)
    if math.isnan(v):
        raise MalformedResponse(f"{where}: log-prob is NaN")
    return float("-inf") if v <= JSON_NEG_INF else v


def _list_field(lp: dict[str, object], name: str, where: str) -> list[object]:
    val = lp.get(name)
    if not isinstance(val, list):
        raise MalformedResponse(f"{where}: 'logprobs.{name}' is {type(val).__name__}, allowed a list")
    return val


def parse_completion(payload: object, *, max_tokens: int, requested: int, vocab_size: int,
                     where: str = "response") -> Heads:
    """Parse one decoded ``/v1/completions`` answer into a :class:`Heads` (``requested``: the ``logprobs``
    sent, 0, -1 or K). Raises :class:`MalformedResponse` naming the field and position of the first
    problem."""
    if not isinstance(payload, dict):
        raise MalformedResponse(f"{where}: the body is {type(payload).__name__}, allowed a JSON object")
    if "error" in payload and "choices" not in payload:
        raise MalformedResponse(f"{where}: the server answered with an error: {payload['error']!r}")
    choices = payload.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        n = len(choices) if isinstance(choices, list) else "no"
        raise MalformedResponse(f"{where}: 'choices' has {n} entries, allowed exactly one completion")
    choice = choices[0]
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        raise MalformedResponse(f"{where}: 'choices[0].logprobs' is missing — the server returned no "
                                "log-probs")
    tokens, token_lps, tops = (_list_field(lp, name, where) for name in ("tokens", "token_logprobs", "top_logprobs"))
    if not (len(tokens) == len(token_lps) == len(tops)):
        raise MalformedResponse(f"{where}: logprobs lists disagree in length (tokens {len(tokens)}, "
                                f"token_logprobs {len(token_lps)}, top_logprobs {len(tops)})")
    if len(tokens) != max_tokens:
        raise MalformedResponse(
            f"{where}: {len(tokens)} tokens returned, {max_tokens} requested with ignore_eos "
            f"(finish_reason={choice.get('finish_reason')!r}); fixed-length completions are required")
    full = requested == FULL_VOCAB or requested >= vocab_size
    out = Heads([], [], [], [], payload=payload)
    for t, (key, value, top) in enumerate(zip(tokens, token_lps, tops, strict=True)):
        y, sampled_lp, head = _position(key, value, top, f"{where} position {t}", full=full, requested=requested,
                                        vocab_size=vocab_size)
        out.completion_ids.append(y)
        out.sampled_logprobs.append(sampled_lp)
        out.head_ids.append([i for i, _ in head])
        out.head_logprobs.append([v for _, v in head])
    return out


def _position(key: object, value: object, top: object, at: str, *, full: bool, requested: int,
              vocab_size: int) -> tuple[int, float, list[tuple[int, float]]]:
    """One position of a completion: the sampled id, its log-prob and the top-K head as the offline engine
    reports it (the sampled entry comes separately)."""
    y = _token_id(key, at)
    if y >= vocab_size:
        raise MalformedResponse(f"{at}: sampled token id {y} is outside the vocabulary of {vocab_size}")
    if value is None:
        raise MalformedResponse(f"{at}: token_logprobs is null — the server returned no log-prob for the sampled token")
    sampled_lp = _logprob(value, at)
    if not isinstance(top, dict):
        raise MalformedResponse(f"{at}: top_logprobs entry is {type(top).__name__}, allowed an object")
    entries = [(_token_id(k, at), _logprob(v, at)) for k, v in top.items()]
    ids = [i for i, _ in entries]
    if any(i >= vocab_size for i in ids):
        raise MalformedResponse(f"{at}: a top_logprobs id is outside the vocabulary of {vocab_size}")
    if len(set(ids)) != len(ids):
        raise MalformedResponse(f"{at}: top_logprobs repeats a token id")
    if y not in ids:
        raise MalformedResponse(f"{at}: the sampled token {y} is missing from top_logprobs")
    if dict(entries)[y] != sampled_lp:
        raise MalformedResponse(
            f"{at}: token_logprobs says {sampled_lp!r} for token {y}, top_logprobs says {dict(entries)[y]!r}")
    if full:
        if len(entries) != vocab_size:
            raise MalformedResponse(f"{at}: {len(entries)} top_logprobs entries for a full-vocabulary request (V={vocab_size})")
        return y, sampled_lp, entries
    if requested == 0:
        if len(entries) != 1:
            raise MalformedResponse(f"{at}: {len(entries)} top_logprobs entries for logprobs=0, allowed 1")
        return y, sampled_lp, []
    if len(entries) == requested:  # the sampled token is one of the top-K
        return y, sampled_lp, entries
    if len(entries) == requested + 1:  # it is not: drop its extra entry
        return y, sampled_lp, [e for e in entries if e[0] != y]
    raise MalformedResponse(
        f"{at}: {len(entries)} top_logprobs entries for logprobs={requested}, allowed {requested} or "
        f"{requested + 1} (the server's --max-logprobs may be lower than the capture needs)")

def check_processed(kept_logprobs: torch.Tensor, incomplete: torch.Tensor, *, url: str, where: str,
                    spec: SamplingSpec | None = None, vocab_size: int | None = None) -> None:
    """Raise :class:`LogprobsModeMismatch` when the captured values cannot be processed log-probs, by the exact
    checks of docs/capture_plan.md, section 7 (``raw_logprobs``, vLLM's default, fails them)."""
    mass = support_mass(kept_logprobs)
    bad = (~incomplete) & ((mass - 1.0).abs() > MASS_TOLERANCE)
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0, 0])
        n_kept = int(torch.isfinite(kept_logprobs[t]).sum())
        raise LogprobsModeMismatch(
            f"{where} position {t}: the returned log-probs of the {n_kept} kept tokens sum to probability "
            f"{float(mass[t]):.6f}, not 1 ({int(bad.sum())} of {len(bad)} complete positions) — "
            + _mode_hint(url))
    if spec is None:
        return
    spec = spec.effective()
    for t in range(kept_logprobs.shape[0]):
        row = kept_logprobs[t].double()
        vals = torch.sort(row[torch.isfinite(row)], descending=True).values
        if vals.numel() == 0:
            continue
        problem = None
        k = spec.top_k
        if spec.uses_top_k and bool(incomplete[t]) and vals.numel() > k:
            spread = float(vals[k - 1] - vals[-1])
            if spread > 1e-5:
                problem = (
                    f"the head is full ({vals.numel()} finite values) but its values from rank {k} on are not tied "
                    f"(spread {spread:.3g}), which top_k={k} cannot keep"
                )
        if problem is None and spec.uses_min_p:
            gap = float(vals[0] - vals[-1])
            if gap > -math.log(spec.min_p) + 1e-4:
                problem = (
                    f"a kept token is {gap:.4g} nats below the most likely one, beyond what min_p={spec.min_p:g} keeps "
                    f"({-math.log(spec.min_p):.4g})"
                )
        if problem is None and spec.uses_top_p and vocab_size is not None and vals.numel() >= vocab_size:
            p_min = math.exp(float(vals[-1]))
            if p_min <= (1.0 - spec.top_p) - 1e-6:
                problem = (
                    f"all {vocab_size} tokens are kept, yet the least likely has probability {p_min:.3g} <= "
                    f"1 - top_p = {1.0 - spec.top_p:.3g}, which top_p={spec.top_p:g} drops")
        if problem is not None:
            raise LogprobsModeMismatch(f"{where} position {t}: {problem} — " + _mode_hint(url))


def check_probe(payload: object, *, url: str, vocab_size: int, max_tokens: int) -> None:
    """Judge the start-up probe (``top_k=1``, ``logprobs=2``): processed log-probs keep one token at log-prob 0
    (or tied tokens sharing the mass equally) and report ``-inf`` for the rest; raw log-probs report the
    unfiltered distribution, more than one finite entry and mass below 1."""
    p = parse_completion(payload, max_tokens=max_tokens, requested=2, vocab_size=vocab_size, where="probe")
    for t, (y, lp, ids, vals) in enumerate(
            zip(p.completion_ids, p.sampled_logprobs, p.head_ids, p.head_logprobs, strict=True)):
        reported = dict(zip(ids, vals, strict=True))
        reported[y] = lp  # the sampled token may sit outside the top-2 head
        finite = [v for v in reported.values() if v != float("-inf")]
        mass = sum(math.exp(v) for v in finite)
        tied = bool(finite) and max(finite) - min(finite) <= 1e-6
        if abs(mass - 1.0) > MASS_TOLERANCE or not tied:
            raise LogprobsModeMismatch(
                f"probe request (top_k=1, logprobs=2) at position {t}: {len(finite)} finite log-prob(s) "
                f"{[round(v, 6) for v in finite]} with probability mass {mass:.6f}, where processed log-probs "
                f"keep one token (here {y}) at log-prob 0 — " + _mode_hint(url)
            )
