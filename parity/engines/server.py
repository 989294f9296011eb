"""Rollout side over HTTP: a vLLM OpenAI-compatible server, spawned on loopback or attached by URL.

Many RL stacks (TRL's server mode, async trainers, verl) sample through ``vllm serve`` rather than an
in-process engine, and launch that server with their own log-prob settings. ``ServerRollout`` has the
interface and record type of :class:`parity.engines.rollout.VllmRollout` (source ``"vllm-server"``),
so the same capture, comparison and gates run on the server path.

What the server is asked, per prompt (one ``/v1/completions`` request each, sent concurrently):
prompt token ids (never text, so tokenization cannot drift), the per-request seed, the spec's
temperature/top_k/top_p/min_p, neutral penalties (a server applies the checkpoint's
``generation_config`` defaults to any field a request leaves out), ``ignore_eos`` with a fixed
``max_tokens``, and ``logprobs=K`` with ``return_tokens_as_token_ids`` so every entry is keyed
``token_id:N``. Response shape (vLLM 0.32, ``OpenAIServingCompletion._create_completion_logprobs``):
``choices[0].logprobs`` holds ``tokens`` (the sampled ids), ``token_logprobs`` (their log-probs) and
``top_logprobs`` — per position one dict whose first key is the sampled token followed by the top-K
(the sampled token appears once: K entries when it is in the top-K, K + 1 when not). ``-inf`` is sent
as ``-9999.0`` (JSON has no infinity), so ``-9999.0`` reads back as "off the support".

Faults end with an error that names the cause, never a hang: every HTTP call has a timeout, a
spawned server that exits is noticed while waiting, and a server that does not return processed
log-probs (vLLM's default ``--logprobs-mode`` is ``raw_logprobs``) is detected twice — by a probe at
start-up (``top_k=1`` must give one kept token at log-prob 0) and on every captured position (the
processed probabilities of a complete kept set sum to 1, see :func:`parity.capture.support_mass`).

Only the standard library talks HTTP (an attached server must not need vLLM on the client), with
proxies disabled: requests go to 127.0.0.1 or to the URL the user gave, nowhere else.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parity.capture import FULL_VOCAB, plan_capture, support_from_heads, support_mass
from parity.records import SequenceRecord
from parity.spec import SamplingSpec

SOURCE = "vllm-server"
# vLLM serialises -inf as this value (``max(logprob, -9999.0)`` in the completion serving code).
JSON_NEG_INF = -9999.0
TOKEN_PREFIX = "token_id:"
# |mass - 1| above this over a complete kept set means the values are not processed log-probs.
MASS_TOLERANCE = 1e-3
EXPECTED_MODE = "processed_logprobs"
PROBE_SENTENCE = "The sampler and the trainer must agree"


class ServerError(RuntimeError):
    """Any failure of the server path; the message names the URL and the cause."""


class _PortTaken(Exception):
    """The spawned server lost the race for its port (internal: retried on another port)."""


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
        f"with --logprobs-mode {EXPECTED_MODE}"
    )


# -- parsing (pure: canned JSON in, lists out) ------------------------------------------------------


@dataclass
class ParsedCompletion:
    """One completion as the server reported it, heads already trimmed to the top-K."""

    token_ids: list[int]
    sampled_logprobs: list[float]
    head_ids: list[
        list[int]
    ]  # per position: the top-K ids (the sampled entry removed when outside the top-K)
    head_logprobs: list[list[float]]  # the same positions' values, -9999.0 read back as -inf


def _token_id(key: Any, where: str) -> int:
    if not isinstance(key, str) or not key.startswith(TOKEN_PREFIX):
        raise MalformedResponse(
            f"{where}: token {key!r} is not of the form 'token_id:N' — the server ignored "
            f"return_tokens_as_token_ids (an OpenAI-compatible server that is not vLLM?)"
        )
    try:
        tid = int(key[len(TOKEN_PREFIX) :])
    except ValueError:
        raise MalformedResponse(f"{where}: token {key!r} has no integer id after 'token_id:'") from None
    if tid < 0:
        raise MalformedResponse(f"{where}: token id {tid} is negative")
    return tid


def _logprob(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedResponse(f"{where}: log-prob {value!r} is not a number")
    v = float(value)
    if math.isnan(v):
        raise MalformedResponse(f"{where}: log-prob is NaN")
    return float("-inf") if v <= JSON_NEG_INF else v


def parse_completion(
    payload: Any,
    *,
    max_tokens: int,
    requested: int,
    vocab_size: int,
    where: str = "response",
) -> ParsedCompletion:
    """Parse one ``/v1/completions`` answer into sampled ids, their log-probs and the top-K heads.

    ``requested`` is the ``logprobs`` value sent (0: sampled token only; -1: full vocabulary; K).
    Raises :class:`MalformedResponse` naming the field and position of the first problem.
    """
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
        raise MalformedResponse(
            f"{where}: 'choices[0].logprobs' is missing — the server returned no log-probs"
        )
    tokens, token_lps, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    for name, val in (("tokens", tokens), ("token_logprobs", token_lps), ("top_logprobs", tops)):
        if not isinstance(val, list):
            raise MalformedResponse(f"{where}: 'logprobs.{name}' is {type(val).__name__}, allowed a list")
    if not (len(tokens) == len(token_lps) == len(tops)):
        raise MalformedResponse(
            f"{where}: logprobs lists disagree in length (tokens {len(tokens)}, token_logprobs {len(token_lps)}, "
            f"top_logprobs {len(tops)})"
        )
    if len(tokens) != max_tokens:
        raise MalformedResponse(
            f"{where}: {len(tokens)} tokens returned, {max_tokens} requested with ignore_eos "
            f"(finish_reason={choice.get('finish_reason')!r}); fixed-length completions are required"
        )
    full = requested == FULL_VOCAB or requested >= vocab_size
    out = ParsedCompletion([], [], [], [])
    for t, (key, value, top) in enumerate(zip(tokens, token_lps, tops, strict=True)):
        at = f"{where} position {t}"
        y = _token_id(key, at)
        if y >= vocab_size:
            raise MalformedResponse(f"{at}: sampled token id {y} is outside the vocabulary of {vocab_size}")
        if value is None:
            raise MalformedResponse(
                f"{at}: token_logprobs is null — the server returned no log-prob for the sampled token"
            )
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
                f"{at}: token_logprobs says {sampled_lp!r} for token {y}, top_logprobs says {dict(entries)[y]!r}"
            )
        # Recover the top-K head the offline engine reports (its sampled entry comes separately).
        if full:
            if len(entries) != vocab_size:
                raise MalformedResponse(
                    f"{at}: {len(entries)} top_logprobs entries for a full-vocabulary request (V={vocab_size})"
                )
            head = entries
        elif requested == 0:
            if len(entries) != 1:
                raise MalformedResponse(
                    f"{at}: {len(entries)} top_logprobs entries for logprobs=0, allowed 1"
                )
            head = []
        elif len(entries) == requested:  # the sampled token is one of the top-K
            head = entries
        elif len(entries) == requested + 1:  # it is not: drop its extra entry
            head = [e for e in entries if e[0] != y]
        else:
            raise MalformedResponse(
                f"{at}: {len(entries)} top_logprobs entries for logprobs={requested}, allowed {requested} or "
                f"{requested + 1} (the server's --max-logprobs may be lower than the capture needs)"
            )
        out.token_ids.append(y)
        out.sampled_logprobs.append(sampled_lp)
        out.head_ids.append([i for i, _ in head])
        out.head_logprobs.append([v for _, v in head])
    return out


def check_processed(
    kept_logprobs: torch.Tensor,
    incomplete: torch.Tensor,
    *,
    url: str,
    where: str,
    spec: SamplingSpec | None = None,
    vocab_size: int | None = None,
) -> None:
    """Raise :class:`LogprobsModeMismatch` when the captured values cannot be processed log-probs.

    Under ``processed_logprobs`` the finite head entries are the filtered, renormalised distribution
    (the support S_q and ``log(p_i / S)`` on it). Checks, each exact for that mode up to float rounding:

    1. a complete kept set carries probability 1 (:func:`parity.capture.support_mass`);
    2. top_k: a head that is full of finite values (incomplete) can only come from tokens tied with
       the k-th value, so every value from rank k on equals the k-th;
    3. min_p: kept tokens satisfy ``p_i >= min_p * p_max``; renormalising keeps ratios, so
       ``max - min <= -log(min_p)`` over the kept values;
    4. top_p: a support that is the whole vocabulary means top_p dropped nothing, so even the least
       likely token has probability above ``1 - top_p``.

    ``raw_logprobs`` (vLLM's default) reports the unfiltered ``log_softmax(z)``: heads are never
    ``-inf``, so top-K captures look incomplete with untied tails (2) and full-vocabulary captures hold
    every token (3, 4). The logits modes fail (1).
    """
    mass = support_mass(kept_logprobs)
    bad = (~incomplete) & ((mass - 1.0).abs() > MASS_TOLERANCE)
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0, 0])
        n_kept = int(torch.isfinite(kept_logprobs[t]).sum())
        raise LogprobsModeMismatch(
            f"{where} position {t}: the returned log-probs of the {n_kept} kept tokens sum to probability "
            f"{float(mass[t]):.6f}, not 1 ({int(bad.sum())} of {len(bad)} complete positions) — "
            + _mode_hint(url)
        )
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
                    f"1 - top_p = {1.0 - spec.top_p:.3g}, which top_p={spec.top_p:g} drops"
                )
        if problem is not None:
            raise LogprobsModeMismatch(f"{where} position {t}: {problem} — " + _mode_hint(url))


def check_probe(payload: Any, *, url: str, vocab_size: int, max_tokens: int) -> None:
    """Judge the start-up probe (``top_k=1``, ``logprobs=2``).

    Processed log-probs under top_k=1 keep one token at log-prob 0 (or tied tokens sharing the mass
    equally) and report ``-inf`` for the rest. Raw log-probs report the unfiltered distribution:
    more than one finite entry, mass below 1.
    """
    parsed = parse_completion(
        payload, max_tokens=max_tokens, requested=2, vocab_size=vocab_size, where="probe"
    )
    for t, (y, lp, ids, vals) in enumerate(
        zip(parsed.token_ids, parsed.sampled_logprobs, parsed.head_ids, parsed.head_logprobs, strict=True)
    ):
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


def compare_with_offline(
    server: Sequence[SequenceRecord], offline: Sequence[SequenceRecord]
) -> dict[str, Any]:
    """Cross-check server records against offline-engine records of the same prompts, seeds and spec.

    Returns token equality, the max |diff| of the sampled log-probs (over positions where both sides
    sampled the same prefix) and of the captured kept sets (same ids, max |diff| of their log-probs).
    """
    if len(server) != len(offline):
        raise ValueError(f"{len(server)} server records vs {len(offline)} offline records")
    out: dict[str, Any] = {
        "sequences": len(server),
        "tokens": 0,
        "tokens_equal": True,
        "first_token_mismatch": None,
        "max_abs_logprob_diff": 0.0,
        "kept_equal": True,
        "max_abs_kept_logprob_diff": 0.0,
        "compared_positions": 0,
    }
    for s, o in zip(server, offline, strict=True):
        if s.prompt_ids != o.prompt_ids or s.seed != o.seed or s.spec != o.spec:
            raise ValueError(f"record {s.prompt_index}: prompt, seed or spec differ between the two sides")
        out["tokens"] += s.length
        n = 0
        while n < min(s.length, o.length) and s.completion_ids[n] == o.completion_ids[n]:
            n += 1
        if n < max(s.length, o.length) and out["tokens_equal"]:
            out["tokens_equal"] = False
            out["first_token_mismatch"] = {"prompt": s.prompt_index, "position": n}
        out["compared_positions"] += n
        if n:
            d = (s.logprobs[:n].double() - o.logprobs[:n].double()).abs().max().item()
            out["max_abs_logprob_diff"] = max(out["max_abs_logprob_diff"], d)
        if (s.kept_ids is None) != (o.kept_ids is None):
            out["kept_equal"] = False
            continue
        if s.kept_ids is None or o.kept_ids is None or s.kept_logprobs is None or o.kept_logprobs is None:
            continue
        for t in range(n):
            a = {int(i): float(v) for i, v in zip(s.kept_ids[t], s.kept_logprobs[t], strict=True) if i >= 0}
            b = {int(i): float(v) for i, v in zip(o.kept_ids[t], o.kept_logprobs[t], strict=True) if i >= 0}
            if a.keys() != b.keys():
                out["kept_equal"] = False
                continue
            if a:
                d = max(abs(a[i] - b[i]) for i in a)
                out["max_abs_kept_logprob_diff"] = max(out["max_abs_kept_logprob_diff"], d)
    return out


# -- process and HTTP plumbing --------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def process_group_alive(pgid: int) -> bool:
    """True while any process of the group exists (zombies of our own children are reaped first)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``; reap the leader."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not process_group_alive(pgid):
                break
            time.sleep(0.05)
        else:
            continue
        break
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent
        pass


def _shutdown(proc: subprocess.Popen[bytes], log_dir: Path, log_state: dict[str, bool]) -> None:
    """Finalizer of a spawned server: kill its group; remove its log unless an error message cites it."""
    _kill_group(proc)
    if not log_state.get("keep"):
        shutil.rmtree(log_dir, ignore_errors=True)


# Child side of the launcher: die with the parent (PR_SET_PDEATHSIG survives exec), then exec the
# server. Covers a parent killed by SIGKILL, where neither atexit nor finally blocks run.
_LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n"
)


def _normalise_url(url: str) -> str:
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--server {url!r} is invalid: allowed 'spawn' or an http(s)://HOST:PORT URL")
    path = parsed.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


class ServerRollout:
    """The sampler under test, behind vLLM's OpenAI-compatible HTTP server.

    ``server="spawn"`` starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 at a free
    port (the ``vllm`` console script of the CPU wheel crashes) and owns it: it is stopped by
    :meth:`close`, on any start-up error, on Ctrl-C and at interpreter exit (its process group is
    killed). Any other value is the URL of a running server to attach to; it is never stopped.
    """

    name = SOURCE

    def __init__(
        self,
        model: str | Path,
        *,
        server: str = "spawn",
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        max_model_len: int = 512,
        full_vocab_limit: int = 4096,
        tie_margin: int = 16,
        head: int | None = None,
        timeout_s: float = 900.0,
        prefix_caching: bool = False,
        startup_timeout_s: float | None = None,
        request_timeout_s: float | None = None,
        concurrency: int = 16,
        logprobs_mode: str = EXPECTED_MODE,
        check_mode: bool = True,
        server_args: Sequence[str] = (),
        capture: str = "topk",
    ) -> None:
        if capture != "topk":
            # vLLM 0.32's /v1/completions has no field for return_sampling_mask; over HTTP the kept set
            # comes from the top-K processed log-probs only.
            raise ValueError(
                f"capture={capture!r} is not available in server mode: vLLM's OpenAI server does not expose "
                f"return_sampling_mask; use capture='topk' (the default)"
            )
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model path {str(model)!r} has no config.json: allowed a Hugging Face checkpoint directory"
            )
        self.model = str(path)
        self.dtype = dtype
        self.device = device
        self.seed = seed
        self.full_vocab_limit = full_vocab_limit
        self.tie_margin = tie_margin
        self.head = head
        self.timeout_s = timeout_s
        self.request_timeout_s = request_timeout_s if request_timeout_s is not None else timeout_s
        self.startup_timeout_s = startup_timeout_s if startup_timeout_s is not None else timeout_s
        self.prefix_caching = prefix_caching
        self.concurrency = max(1, concurrency)
        self.capture_s = 0.0
        self.init_s = 0.0
        self.max_model_len_arg = max_model_len
        self.url: str | None = None
        self.spawned = server == "spawn"
        self._closed = False
        self._log_state = {"keep": False}  # shared with the finalizer, which must not hold self
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self._finalizer: weakref.finalize | None = None
        self._spawn_name: str | None = None
        # No proxies, ever: the harness talks to loopback or to the URL it was given, directly.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        attach_url = None if self.spawned else _normalise_url(server)
        self.vocab_size = self._config_vocab_size(path)
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        start = time.perf_counter()
        try:
            if self.spawned:
                self.url = self._spawn(path, logprobs_mode=logprobs_mode, server_args=server_args)
            else:
                self.url = attach_url
            self.served_model, self.max_model_len = self._models()
            if check_mode:
                self.probe_logprobs_mode()
        except BaseException:  # including KeyboardInterrupt: never leave a spawned server behind
            self.close()
            raise
        self.init_s = time.perf_counter() - start

    # -- set-up -------------------------------------------------------------------------------

    @staticmethod
    def _config_vocab_size(path: Path) -> int:
        """The vocabulary the server's model config declares (what vLLM's ``get_vocab_size`` reads)."""
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(path))
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        v = getattr(text, "vocab_size", None)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"model config at {path} declares no vocab_size")
        return v

    def _spawn(self, path: Path, *, logprobs_mode: str, server_args: Sequence[str]) -> str:
        # A free port can be taken between the probe and the server's bind (other test runs spawn
        # servers too): the server then exits with "address already in use", and we try another port.
        for attempt in range(3):
            try:
                return self._spawn_once(path, logprobs_mode=logprobs_mode, server_args=server_args)
            except _PortTaken:
                if attempt == 2:
                    raise ServerError(
                        f"could not bind a free port on 127.0.0.1 in 3 attempts{self._log_tail()}"
                    ) from None
                self._log_state["keep"] = False
                self._stop_process()
        raise AssertionError("unreachable")

    def _spawn_once(self, path: Path, *, logprobs_mode: str, server_args: Sequence[str]) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.url = url  # for error messages while it starts
        # A name only this server answers to: /v1/models then proves the port is ours, not another
        # server's that grabbed it first.
        self._spawn_name = f"parity-{uuid.uuid4().hex[:12]}"
        args = [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--logprobs-mode",
            logprobs_mode,
            # -1: up to the whole vocabulary, the most any capture plan asks for (full-vocabulary
            # capture of top_p/min_p specs); the offline engine is configured the same way.
            "--max-logprobs",
            "-1",
            "--dtype",
            self.dtype,
            "--seed",
            str(self.seed),
            "--max-model-len",
            str(self.max_model_len_arg),
            "--enforce-eager",
            # vLLM's server turns prefix caching on by default; the offline engine has it off unless
            # asked, so the two sides run the same configuration.
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            # Prompts go in as ids and log-prob keys come back as ids: the server never needs to
            # (de)tokenize, and candidate detokenization dominates full-vocabulary capture cost.
            "--skip-tokenizer-init",
            "--disable-uvicorn-access-log",
            "--served-model-name",
            self._spawn_name,
            *server_args,
        ]
        env = dict(os.environ)
        if self.device == "cpu":
            for k, v in (
                ("VLLM_CPU_KVCACHE_SPACE", "1"),
                ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
                ("VLLM_LOGGING_LEVEL", "WARNING"),
                ("TOKENIZERS_PARALLELISM", "false"),
            ):
                env.setdefault(k, v)
        log_dir = Path(tempfile.mkdtemp(prefix="parity-server-"))
        self.log_path = log_dir / "server.log"
        if threading.current_thread() is threading.main_thread():
            # PR_SET_PDEATHSIG fires when the spawning *thread* ends; only the main thread lives as long
            # as the process.
            cmd = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *args]
        else:
            cmd = [sys.executable, *args]
        self._log_state = {"keep": False}
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # own process group: killed as a whole, immune to the terminal's Ctrl-C
            )
        # Runs on close(), on garbage collection and at interpreter exit (atexit), whichever is first.
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, log_dir, self._log_state)
        self._wait_ready(url)
        return url

    def _log_tail(self, lines: int = 15) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_bytes()[-8000:].decode(errors="replace").strip().splitlines()
        tail = "\n".join(text[-lines:])
        self._log_state["keep"] = True  # an error message points at it
        return f"\n--- last lines of {self.log_path} ---\n{tail}" if tail else ""

    def _exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def _wait_ready(self, url: str) -> None:
        """Poll until the server answers /v1/models with our name; fail fast if the process exits."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self._exited()
            if code is not None:
                tail = self._log_tail()
                if "address already in use" in tail.lower():
                    raise _PortTaken(url)
                raise ServerError(
                    f"the vLLM server spawned for {self.model} at {url} exited with code {code} before it was ready"
                    + tail
                )
            try:
                with self._opener.open(url + "/v1/models", timeout=2.0) as resp:
                    ids = [m.get("id") for m in json.loads(resp.read()).get("data", [])]
                    if self._spawn_name in ids:
                        return
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError, AttributeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the vLLM server spawned at {url} was not ready within {self.startup_timeout_s:.0f} s "
                    f"(raise --timeout if the model is large)" + self._log_tail()
                )
            time.sleep(0.5)

    def _models(self) -> tuple[str, int | None]:
        data = self._request(
            "GET", "/v1/models", None, timeout=min(30.0, self.request_timeout_s), what="GET /v1/models"
        )
        models = data.get("data") if isinstance(data, dict) else None
        if (
            not isinstance(models, list)
            or not models
            or not isinstance(models[0], dict)
            or "id" not in models[0]
        ):
            raise MalformedResponse(f"{self.url}/v1/models lists no model: {str(data)[:200]}")
        m = next((x for x in models if isinstance(x, dict) and x.get("id") == self._spawn_name), models[0])
        return str(m["id"]), m.get("max_model_len")

    # -- HTTP ---------------------------------------------------------------------------------

    def _request(
        self, method: str, route: str, body: dict[str, Any] | None, *, timeout: float, what: str
    ) -> Any:
        """One HTTP exchange; every failure becomes a :class:`ServerError` or ``TimeoutError`` naming the URL."""
        url = self.url + route
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:600].decode(errors="replace")
            try:
                msg = json.loads(detail).get("error", {}).get("message", detail)
            except (ValueError, AttributeError):
                msg = detail
            hint = (
                " (start the server with a larger --max-logprobs)" if "logprobs" in str(msg).lower() else ""
            )
            raise ServerError(f"{what} to {url} failed: HTTP {exc.code}: {msg}{hint}") from None
        except TimeoutError:
            self._raise_if_died(what)
            raise TimeoutError(
                f"{what} to {url}: no answer within {timeout:.0f} s (server hung or overloaded)"
            ) from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError) as exc:
            self._raise_if_died(what, grace_s=2.0)
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise TimeoutError(
                    f"{what} to {url}: no answer within {timeout:.0f} s (server hung or overloaded)"
                ) from None
            if isinstance(reason, ConnectionRefusedError):
                raise ServerUnreachable(
                    f"{what}: nothing is listening at {url} (connection refused) — is the vLLM server running "
                    f"and is the port right?"
                ) from None
            if isinstance(
                reason, (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError)
            ) or isinstance(exc, (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError)):
                raise ServerDied(
                    f"{what}: the server at {url} dropped the connection ({reason!r}); did it crash?"
                ) from None
            raise ServerUnreachable(f"{what}: cannot reach the server at {url}: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise MalformedResponse(f"{what} to {url}: the body is not JSON: {raw[:200]!r}") from None

    def _raise_if_died(self, what: str, grace_s: float = 0.0) -> None:
        if grace_s and self.proc is not None:
            try:  # a dropped connection usually means it is exiting: give it a moment to be reaped
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        code = self._exited()
        if code is not None:
            raise ServerDied(
                f"{what}: the vLLM server at {self.url} (pid {self.proc.pid if self.proc else '?'}) exited with code "
                f"{code} during the run" + self._log_tail()
            )

    # -- the rollout interface ----------------------------------------------------------------

    def tokenizer(self) -> Any:
        return self._tokenizer

    def _body(
        self, prompt: Sequence[int], spec: SamplingSpec, *, max_tokens: int, seed: int, logprobs: int
    ) -> dict[str, Any]:
        kw = spec.sampling_params_kwargs()
        return {
            "model": self.served_model,
            "prompt": [int(t) for t in prompt],
            "max_tokens": int(max_tokens),
            "n": 1,
            "stream": False,
            "seed": int(seed),
            "temperature": kw["temperature"],
            "top_k": kw["top_k"],
            "top_p": kw["top_p"],
            "min_p": kw["min_p"],
            # A server fills omitted fields from the checkpoint's generation_config; pin them neutral,
            # as the offline SamplingParams are.
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "ignore_eos": True,
            "logprobs": int(logprobs),
            "return_tokens_as_token_ids": True,
        }

    def probe_logprobs_mode(self) -> None:
        """Ask for top_k=1 with two log-probs; refuse a server whose kept mass is not 1 (raw mode)."""
        ids = list(self._tokenizer.encode(PROBE_SENTENCE, add_special_tokens=False))[:8] or [0]
        ids = [i for i in ids if i < self.vocab_size] or [0]
        max_tokens = 4
        body = self._body(
            ids, SamplingSpec(temperature=1.0, top_k=1), max_tokens=max_tokens, seed=self.seed, logprobs=2
        )
        data = self._request(
            "POST", "/v1/completions", body, timeout=self.request_timeout_s, what="probe request"
        )
        check_probe(data, url=self.url, vocab_size=self.vocab_size, max_tokens=max_tokens)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        spec: SamplingSpec,
        *,
        max_tokens: int,
        seed: int,
    ) -> list[SequenceRecord]:
        """Sample one completion per prompt (seed ``seed + i``) through the server; record log-probs and S_q."""
        if self._closed or self.url is None:
            raise ServerError("the server rollout is closed")
        plan = plan_capture(
            spec,
            self.vocab_size,
            head=self.head,
            tie_margin=self.tie_margin,
            full_vocab_limit=self.full_vocab_limit,
        )
        requested = plan.logprobs if plan.logprobs is not None else 0
        label = spec.label()
        start = time.perf_counter()
        payloads = self._send_all(
            [
                self._body(p, spec, max_tokens=max_tokens, seed=seed + i, logprobs=requested)
                for i, p in enumerate(prompts)
            ],
            what=f"completion ({label})",
        )
        self.capture_s += time.perf_counter() - start
        records = []
        for i, payload in enumerate(payloads):
            where = f"{self.url} completion for prompt {i} ({label})"
            parsed = parse_completion(
                payload, max_tokens=max_tokens, requested=requested, vocab_size=self.vocab_size, where=where
            )
            kept = kept_lp = incomplete = None
            extras: dict[str, torch.Tensor] = {}
            if plan.captures_support:
                cap = support_from_heads(
                    parsed.token_ids,
                    parsed.head_ids,
                    parsed.head_logprobs,
                    requested=plan.logprobs or FULL_VOCAB,
                    vocab_size=self.vocab_size,
                )
                check_processed(
                    cap.kept_logprobs,
                    cap.incomplete,
                    url=self.url,
                    where=where,
                    spec=spec,
                    vocab_size=self.vocab_size,
                )
                kept, kept_lp, incomplete = cap.kept_ids, cap.kept_logprobs, cap.incomplete
                extras["sampled_missing"] = cap.sampled_missing
            records.append(
                SequenceRecord(
                    source=self.name,
                    prompt_index=i,
                    prompt_ids=list(prompts[i]),
                    completion_ids=parsed.token_ids,
                    spec=spec,
                    seed=seed + i,
                    logprobs=torch.tensor(parsed.sampled_logprobs, dtype=torch.float32),
                    kept_ids=kept,
                    kept_logprobs=kept_lp,
                    incomplete=incomplete,
                    extras=extras,
                )
            )
        return records

    def _send_all(self, bodies: list[dict[str, Any]], *, what: str) -> list[Any]:
        """POST every body concurrently (the server batches them); fail fast on the first error.

        Daemon threads, not an executor: a worker blocked on a dead socket must not keep the
        interpreter from exiting (executor threads are joined at exit, before atexit handlers run).
        """
        results: list[Any] = [None] * len(bodies)
        errors: list[BaseException] = []
        done = threading.Semaphore(0)
        next_index = iter(range(len(bodies)))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if errors:
                        return
                    i = next(next_index, None)
                if i is None:
                    return
                try:
                    results[i] = self._request(
                        "POST",
                        "/v1/completions",
                        bodies[i],
                        timeout=self.request_timeout_s,
                        what=f"{what} prompt {i}",
                    )
                except ServerUnreachable as exc:
                    # It answered the set-up requests, so it stopped answering mid-run.
                    with lock:
                        errors.append(
                            ServerDied(f"the server at {self.url} stopped answering during the run: {exc}")
                        )
                    done.release()
                    return
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                    with lock:
                        errors.append(exc)
                    done.release()
                    return
                done.release()

        n_workers = min(self.concurrency, len(bodies))
        for _ in range(n_workers):
            threading.Thread(target=worker, name="parity-server-request", daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        finished = 0
        while finished < len(bodies):
            if done.acquire(timeout=0.25):
                with lock:
                    if errors:
                        raise errors[0]
                finished += 1
                continue
            self._raise_if_died(what)
            if time.monotonic() > deadline:
                with lock:
                    errors.append(TimeoutError("cancelled"))
                raise TimeoutError(
                    f"{what} at {self.url}: {finished} of {len(bodies)} requests done after {self.timeout_s:.0f} s "
                    f"(raise --timeout if the model is large)"
                )
        return results

    def _stop_process(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills the group and drops the log once; later calls are no-ops

    def close(self) -> None:
        """Stop a spawned server (its whole process group) and release the log; attached servers stay up."""
        self._closed = True
        self._stop_process()

    @property
    def pid(self) -> int | None:
        """The spawned server's pid (also its process group id); None when attached."""
        return None if self.proc is None else self.proc.pid
