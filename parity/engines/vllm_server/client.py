"""Rollout side over HTTP: a vLLM OpenAI-compatible server, spawned on loopback or attached by URL.
``ServerRollout`` has ``VllmRollout``'s interface and record type (source ``"vllm-server"``): one concurrent
``/v1/completions`` request per prompt, parsed by :mod:`parity.engines.vllm_server.protocol`. Faults end with
an error naming the cause, never a hang; only the standard library talks HTTP, proxies off."""

from __future__ import annotations

import http.client
import json
import math
import os
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
from pathlib import Path
from typing import TYPE_CHECKING, Unpack

from parity.core.capture import Heads, run_capture
from parity.core.json_types import JsonObject
from parity.core.sequence import SequenceRecord
from parity.core.spec import SPEC_FIELDS, SamplingSpec
from parity.engines.engine_log import log_tail
from parity.engines.rollout_base import RolloutBase, RolloutSettings, Support
from parity.engines.vllm_offline import configure_cpu_env
from parity.engines.vllm_server.process import LAUNCHER, free_port, shutdown
from parity.engines.vllm_server.protocol import (
    EXPECTED_MODE,
    PROBE_SENTENCE,
    SOURCE,
    MalformedResponse,
    ServerDied,
    ServerError,
    ServerUnreachable,
    check_probe,
    check_processed,
    parse_completion,
)
from parity.errors import TimedOut, UsageError
from parity.fixtures import config_vocab_size

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class _PortTaken(Exception):
    """The spawned server lost the race for its port (internal: retried on another port)."""


def _normalise_url(url: str) -> str:
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise UsageError(f"--server {url!r} is invalid: allowed 'spawn' or an http(s)://HOST:PORT URL")
    path = parsed.path.rstrip("/").removesuffix("/v1")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def _heads_differ(a: Heads, b: Heads) -> bool:
    """Two answers to one seeded prompt differ beyond float32 noise: other tokens, or a head log-prob moved by more
    than 1e-4 nats (a filled default moves them by orders more; the same request repeats bit for bit)."""
    if a.completion_ids != b.completion_ids or a.head_ids != b.head_ids:
        return True
    return any(abs(x - y) > 1e-4 for ra, rb in zip(a.head_logprobs, b.head_logprobs, strict=True)
               for x, y in zip(ra, rb, strict=True) if math.isfinite(x) or math.isfinite(y))


def describe_generation_defaults(filled: Sequence[str]) -> str:
    """The one line parity prints about a server's generation-config defaults."""
    if not filled:
        return "server defaults: none: a request that omits a sampling field gets vLLM's neutral value"
    return (f"server defaults: the server fills {', '.join(filled)} from the model's generation_config when a request "
            "omits them; a framework that omits them samples with them (parity sends every field)")


class ServerRollout(RolloutBase):
    """The sampler under test, behind vLLM's OpenAI-compatible HTTP server. ``server="spawn"`` starts
    ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (the CPU wheel's ``vllm`` script crashes) and
    stops it on :meth:`close`, start-up errors, Ctrl-C and exit; any other value is a running server's URL, never stopped."""

    name = SOURCE

    def __init__(self, model: str | Path, *, server: str = "spawn", startup_timeout_s: float | None = None,
                 request_timeout_s: float | None = None, concurrency: int = 16,
                 logprobs_mode: str = EXPECTED_MODE, check_mode: bool = True, server_args: Sequence[str] = (),
                 **settings: Unpack[RolloutSettings]) -> None:
        """``settings``: those of :class:`~parity.engines.rollout_base.RolloutBase`."""
        capture = settings.get("capture", "topk")
        if capture != "topk":
            # vLLM 0.32's /v1/completions has no field for return_sampling_mask; over HTTP the kept set
            # comes from the top-K processed log-probs only.
            raise UsageError(f"capture={capture!r} is not available in server mode: vLLM's OpenAI server "
                             "does not expose return_sampling_mask; use capture='topk' (the default)")
        super().__init__(model, **settings)
        path, timeout_s = self.path, self.timeout_s
        self.request_timeout_s = request_timeout_s if request_timeout_s is not None else timeout_s
        self.startup_timeout_s = startup_timeout_s if startup_timeout_s is not None else timeout_s
        self.concurrency = max(1, concurrency)
        self.url: str | None = None
        self.spawned = server == "spawn"
        self._closed = False
        self._log_state = {"keep": False}  # shared with the finalizer, which must not hold self
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self._finalizer: weakref.finalize[[subprocess.Popen[bytes], Path, dict[str, bool]], ServerRollout] | None = None
        self._spawn_name: str | None = None
        self.generation_defaults: list[str] | None = None  # probe_generation_defaults(), once asked
        # No proxies, ever: the harness talks to loopback or to the URL it was given, directly.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        attach_url = None if self.spawned else _normalise_url(server)
        self.vocab_size = config_vocab_size(path)
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        try:
            self.url = self._spawn(path, logprobs_mode, server_args) if self.spawned else attach_url
            self.served_model, self.max_model_len = self._models()
            if check_mode:
                self.probe_logprobs_mode()
        except BaseException:  # including KeyboardInterrupt: never leave a spawned server behind
            self.close()
            raise

    # -- set-up -------------------------------------------------------------------------------

    def _spawn(self, path: Path, logprobs_mode: str, server_args: Sequence[str]) -> str:
        # A free port can be taken between the probe and the server's bind (other test runs spawn
        # servers too): the server then exits with "address already in use", and we try another port.
        for attempt in range(3):
            try:
                return self._spawn_once(path, logprobs_mode, server_args)
            except _PortTaken:
                if attempt == 2:
                    break
                self._log_state["keep"] = False
                self._stop_process()
        raise ServerError(f"could not bind a free port on 127.0.0.1 in 3 attempts{self._log_tail()}")

    def _spawn_once(self, path: Path, logprobs_mode: str, server_args: Sequence[str]) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.url = url  # for error messages while it starts
        # A name only this server answers to: /v1/models then proves the port is ours, not another
        # server's that grabbed it first.
        self._spawn_name = f"parity-{uuid.uuid4().hex[:12]}"
        args = [
            "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(path),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--logprobs-mode", logprobs_mode,
            # -1: up to the whole vocabulary, the most any capture plan asks for (a forced full head,
            # or an adaptive cap at the vocabulary); the offline engine is configured the same way.
            "--max-logprobs", "-1",
            "--dtype", self.dtype,
            "--seed", str(self.seed),
            "--max-model-len", str(self.max_model_len_arg),
            "--enforce-eager",
            # vLLM's server turns prefix caching on by default; the offline engine has it off unless
            # asked, so the two sides run the same configuration.
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            # Prompts go in as ids and log-prob keys come back as ids: the server never needs to
            # (de)tokenize, and candidate detokenization dominates full-vocabulary capture cost.
            "--skip-tokenizer-init",
            "--disable-uvicorn-access-log",
            "--served-model-name", self._spawn_name,
            *server_args,
        ]
        env = dict(os.environ)
        if self.device == "cpu":
            configure_cpu_env(env)
        log_dir = Path(tempfile.mkdtemp(prefix="parity-server-"))
        self.log_path = log_dir / "server.log"
        if threading.current_thread() is threading.main_thread():
            # PR_SET_PDEATHSIG fires when the spawning *thread* ends; only the main thread lives as long
            # as the process.
            cmd = [sys.executable, "-c", LAUNCHER, str(os.getpid()), *args]
        else:
            cmd = [sys.executable, *args]
        self._log_state = {"keep": False}
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # own process group: killed as a whole, immune to the terminal's Ctrl-C
            )
        # Runs on close(), on garbage collection and at interpreter exit (atexit), whichever is first.
        self._finalizer = weakref.finalize(self, shutdown, self.proc, log_dir, self._log_state)
        self._wait_ready(url)
        return url

    def _log_tail(self, lines: int = 15) -> str:
        tail = log_tail(self.log_path, lines) if self.log_path is not None else []
        if not tail:
            return ""
        self._log_state["keep"] = True  # an error message points at it
        return f"\n--- last lines of {self.log_path} ---\n" + "\n".join(tail)

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
                raise ServerError(f"the vLLM server spawned for {self.model} at {url} exited with code "
                                  f"{code} before it was ready{tail}")
            try:
                with self._opener.open(url + "/v1/models", timeout=2.0) as resp:
                    ids = [m.get("id") for m in json.loads(resp.read()).get("data", [])]
                    if self._spawn_name in ids:
                        return
            except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError, AttributeError):
                pass
            if time.monotonic() > deadline:
                raise TimedOut(f"the vLLM server spawned at {url} was not ready within "
                               f"{self.startup_timeout_s:.0f} s (raise --timeout if the model is large)"
                               + self._log_tail())
            time.sleep(0.5)

    def _models(self) -> tuple[str, int | None]:
        data = self._request("GET", "/v1/models", None, timeout=min(30.0, self.request_timeout_s),
                             what="GET /v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if not (isinstance(models, list) and models and isinstance(models[0], dict) and "id" in models[0]):
            raise MalformedResponse(f"{self.url}/v1/models lists no model: {str(data)[:200]}")
        m = next((x for x in models if isinstance(x, dict) and x.get("id") == self._spawn_name), models[0])
        return str(m["id"]), m.get("max_model_len")

    # -- HTTP ---------------------------------------------------------------------------------

    def _post(self, body: JsonObject, what: str) -> object:
        return self._request("POST", "/v1/completions", body, timeout=self.request_timeout_s, what=what)

    def _request(self, method: str, route: str, body: JsonObject | None, *, timeout: float,
                 what: str) -> object:
        """One HTTP exchange; every failure becomes a :class:`ServerError` or :class:`~parity.errors.TimedOut` naming the URL."""
        assert self.url is not None  # set before the first request
        url = self.url + route
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:600].decode(errors="replace")
            try:
                msg = json.loads(detail).get("error", {}).get("message", detail)
            except (ValueError, AttributeError):
                msg = detail
            hint = (" (start the server with a larger --max-logprobs)"
                    if "logprobs" in str(msg).lower() else "")
            raise ServerError(f"{what} to {url} failed: HTTP {exc.code}: {msg}{hint}") from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError) as exc:
            reason = getattr(exc, "reason", exc)  # URLError wraps the socket's error
            if isinstance(reason, TimeoutError):
                self._raise_if_died(what)
                raise TimedOut(
                    f"{what} to {url}: no answer within {timeout:.0f} s (server hung or overloaded)"
                ) from None
            self._raise_if_died(what, grace_s=2.0)
            if isinstance(reason, ConnectionRefusedError):
                raise ServerUnreachable(
                    f"{what}: nothing is listening at {url} (connection refused) — is the vLLM server running "
                    f"and is the port right?"
                ) from None
            dropped = (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError)
            if isinstance(reason, dropped) or isinstance(exc, dropped):
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
            pid = self.proc.pid if self.proc else "?"
            raise ServerDied(f"{what}: the vLLM server at {self.url} (pid {pid}) exited with code {code} "
                             "during the run" + self._log_tail())

    # -- the rollout interface ----------------------------------------------------------------

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    def _body(self, prompt: Sequence[int], spec: SamplingSpec, *, max_tokens: int, seed: int,
              logprobs: int) -> JsonObject:
        """One prompt's request: token ids (never text), the seed, the spec's filters and penalties (sent even when
        neutral: a server fills an omitted field from the checkpoint's generation_config),
        ``ignore_eos`` with a fixed ``max_tokens``, and ``logprobs=K`` with ``return_tokens_as_token_ids``."""
        return {"model": self.served_model, "prompt": [int(t) for t in prompt], "max_tokens": int(max_tokens),
                "n": 1, "stream": False, "seed": int(seed), **spec.sampling_params_kwargs(),
                "ignore_eos": True, "logprobs": int(logprobs), "return_tokens_as_token_ids": True}

    def _probe_ids(self) -> list[int]:
        ids = list(self._tokenizer.encode(PROBE_SENTENCE, add_special_tokens=False))[:8] or [0]
        return [i for i in ids if i < self.vocab_size] or [0]

    def probe_generation_defaults(self) -> list[str]:
        """The sampling fields this server fills from the model's generation config when a request omits them,
        found the way a framework meets them: by omitting one field at a time (every other field pinned neutral)
        and comparing the head log-probs with those of the all-pinned request. The server's files are not read."""
        ids = self._probe_ids() * 2  # repeated tokens: a repetition penalty moves them
        max_tokens, k = 4, 8

        def ask(body: JsonObject, what: str) -> Heads:
            data = self._post(body, what)
            return parse_completion(data, max_tokens=max_tokens, requested=k, vocab_size=self.vocab_size, where=what)

        pinned = self._body(ids, SamplingSpec(temperature=1.0), max_tokens=max_tokens, seed=self.seed, logprobs=k)
        base = ask(pinned, "generation-defaults probe")
        filled = []
        # The request fields vLLM's server fills from generation_config.json when a request omits them
        # (ModelConfig.get_diff_sampling_param).
        for field in SPEC_FIELDS:
            body = {key: v for key, v in pinned.items() if key != field}
            if _heads_differ(base, ask(body, f"generation-defaults probe without {field}")):
                filled.append(field)
        return filled

    def probe_logprobs_mode(self) -> None:
        """Ask for top_k=1 with two log-probs; refuse a server whose kept mass is not 1 (raw mode)."""
        max_tokens = 4
        body = self._body(self._probe_ids(), SamplingSpec(temperature=1.0, top_k=1), max_tokens=max_tokens,
                          seed=self.seed, logprobs=2)
        data = self._post(body, "probe request")
        assert self.url is not None  # probed once the server is up
        check_probe(data, url=self.url, vocab_size=self.vocab_size, max_tokens=max_tokens)

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, max_tokens: int,
                 seed: int) -> list[SequenceRecord]:
        """Sample one completion per prompt (seed ``seed + i``) through the server; record log-probs and S_q.
        The same call as :meth:`parity.engines.vllm_offline.VllmRollout.generate` (symmetric adapters)."""
        if self._closed or self.url is None:
            raise ServerError("the server rollout is closed")
        label = spec.label()
        deadline = time.monotonic() + self.timeout_s

        def ask(indices: list[int], heads: list[int]) -> list[Heads]:
            bodies = [self._body(prompts[i], spec, max_tokens=max_tokens, seed=seed + i, logprobs=k)
                      for i, k in zip(indices, heads, strict=True)]
            payloads = self._send_all(bodies, what=f"completion ({label})", deadline=deadline)
            return [parse_completion(payload, max_tokens=max_tokens, requested=k, vocab_size=self.vocab_size,
                                     where=self._where(i, spec))
                    for i, k, payload in zip(indices, heads, payloads, strict=True)]

        result = run_capture(self.plan(spec), len(prompts), ask, vocab_size=self.vocab_size, spec=spec,
                             history=self.capture_history)
        return self.records(prompts, spec, seed, result)

    def capture_request(self, body: JsonObject, spec: SamplingSpec) -> tuple[object, SequenceRecord]:
        """Send another client's ``/v1/completions`` body with its head widened to this rollout's capture plan
        (its own seed, so every widening draws the same tokens); return the answer to hand back to that client
        and its record (S_q from the head). The body must carry token-id ``prompt`` and an integer ``seed``."""
        prompt, seed = body.get("prompt"), body.get("seed")
        ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)] if isinstance(prompt, list) else []
        if not isinstance(prompt, list) or not ids or len(ids) != len(prompt):
            raise UsageError(f"capture_request: prompt is {str(prompt)[:80]!r}: allowed a list of token ids")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise UsageError(f"capture_request: seed is {seed!r}: allowed an integer (a widened head must draw the same tokens)")
        if self._closed or self.url is None:
            raise ServerError("the server rollout is closed")
        deadline = time.monotonic() + self.timeout_s

        def ask(indices: list[int], heads: list[int]) -> list[Heads]:
            out = []
            for k in heads:
                if time.monotonic() > deadline:
                    raise TimedOut(f"capture of a client request at {self.url}: not done after {self.timeout_s:.0f} s")
                wide: JsonObject = {**body, "logprobs": int(k), "return_tokens_as_token_ids": True}
                payload = self._post(wide, f"client request ({spec.label()}, logprobs={k})")
                out.append(parse_completion(payload, max_tokens=_completion_length(payload), requested=k,
                                            vocab_size=self.vocab_size, where=f"{self.url} client request"))
            return out

        result = run_capture(self.plan(spec), 1, ask, vocab_size=self.vocab_size, spec=spec,
                             history=self.capture_history)
        (record,) = self.records([ids], spec, seed, result)
        return result.heads[0].payload, record

    def support(self, i: int, h: Heads, requested: int, spec: SamplingSpec) -> Support:
        """S_q from the top-K heads, refused unless it reads as processed log-probs (:func:`check_processed`)."""
        kept, kept_lp, incomplete, extras = super().support(i, h, requested, spec)
        if kept_lp is not None and incomplete is not None:
            assert self.url is not None  # generate() refuses a closed rollout
            check_processed(kept_lp, incomplete, url=self.url, where=self._where(i, spec), spec=spec,
                            vocab_size=self.vocab_size)
        return kept, kept_lp, incomplete, extras

    def _where(self, i: int, spec: SamplingSpec) -> str:
        return f"{self.url} completion for prompt {i} ({spec.label()})"

    def _send_all(self, bodies: list[JsonObject], *, what: str, deadline: float) -> list[object]:
        """POST every body concurrently (the server batches them); fail fast on the first error, by ``deadline``.
        Daemon threads, not an executor: a worker blocked on a dead socket must not keep the interpreter from
        exiting."""
        results: list[object] = [None] * len(bodies)
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
                    results[i] = self._post(bodies[i], f"{what} prompt {i}")
                except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                    if isinstance(exc, ServerUnreachable):
                        # It answered the set-up requests, so it stopped answering mid-run.
                        exc = ServerDied(f"the server at {self.url} stopped answering during the run: {exc}")
                    with lock:
                        errors.append(exc)
                    return
                finally:
                    done.release()

        for _ in range(min(self.concurrency, len(bodies))):
            threading.Thread(target=worker, name="parity-server-request", daemon=True).start()
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
                raise TimedOut(f"{what} at {self.url}: {finished} of {len(bodies)} requests done after "
                               f"{self.timeout_s:.0f} s (raise --timeout if the model is large)")
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


def _completion_length(payload: object) -> int:
    """How many tokens an answer returned (a client's request may stop at EOS; :func:`parse_completion` checks the rest)."""
    try:
        tokens = payload["choices"][0]["logprobs"]["tokens"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        raise MalformedResponse(f"the answer has no choices[0].logprobs.tokens: {str(payload)[:200]}") from None
    if not isinstance(tokens, list):
        raise MalformedResponse(f"choices[0].logprobs.tokens is {type(tokens).__name__}, allowed a list")
    return len(tokens)
