"""A loopback proxy between a rollout client (TRL's asynchronous worker) and a vLLM server: each
``/v1/completions`` request goes on with its top-K head widened to parity's capture plan (the client's own seed,
so the same draw) and the kept set S_q of every position is stored by token prefix (:class:`KeptSets`) for a
trainer to replay. Everything else passes through untouched. Standard library only, proxies off."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from parity.core.sequence import SequenceRecord
from parity.core.spec import PENALTY_OFF, SamplingSpec
from parity.errors import UsageError

if TYPE_CHECKING:
    from parity.engines.vllm_server.client import ServerRollout

COMPLETIONS = "/v1/completions"
# Request fields parity's spec does not model: a request that sets them to anything but neutral is refused.
NEUTRAL = PENALTY_OFF


def spec_of_request(body: dict[str, object]) -> SamplingSpec:
    """The filters of an OpenAI-style completion request, as vLLM reads them (an absent field is off)."""
    for name, neutral in NEUTRAL.items():
        if body.get(name, neutral) != neutral:
            raise UsageError(f"request field {name}={body[name]!r}: allowed {neutral} (parity's capture models "
                             f"temperature, top_k, top_p and min_p only)")
    min_p = body.get("min_p")
    return SamplingSpec.from_dict({"temperature": body.get("temperature", 1.0), "top_k": body.get("top_k", 0),
                                   "top_p": body.get("top_p", 1.0), "min_p": 0.0 if min_p is None else min_p})


class KeptSets:
    """S_q by token prefix: ``prefix`` (prompt and completion up to a position) -> the ids the sampler kept for
    the next token; ``None`` where nothing was filtered (S_q is the vocabulary). Thread-safe.
    ``shift`` plants a fault for tests: each position gets the kept set of ``shift`` decoding steps earlier."""

    def __init__(self, *, shift: int = 0) -> None:
        if shift < 0:
            raise UsageError(f"shift={shift}: allowed 0 (the right step) or a positive number of steps back")
        self.shift = shift
        self._sets: dict[tuple[int, ...], tuple[int, ...] | None] = {}
        self.incomplete = 0  # positions whose head did not prove S_q complete
        self.records: list[SequenceRecord] = []
        self._lock = threading.Lock()

    def add(self, record: SequenceRecord) -> None:
        prompt, ids = list(record.prompt_ids), list(record.completion_ids)
        kept = record.kept_ids
        with self._lock:
            self.records.append(record)
            if record.incomplete is not None:
                self.incomplete += int(record.incomplete.sum())
            for t in range(len(ids)):
                src = max(t - self.shift, 0)
                row = None if kept is None else tuple(int(i) for i in kept[src].tolist() if int(i) >= 0)
                self._sets[tuple(prompt + ids[:t])] = row

    def lookup(self, prefix: Iterable[int]) -> tuple[int, ...] | None:
        key = tuple(int(t) for t in prefix)
        with self._lock:
            if key not in self._sets:
                raise KeyError(f"no kept set captured after a prefix of {len(key)} tokens ending {list(key[-4:])}")
            return self._sets[key]

    def __len__(self) -> int:
        return len(self._sets)


class CaptureProxy:
    """Serves on 127.0.0.1 in a daemon thread; ``url`` is what the client is pointed at. Errors of a capture are
    answered with HTTP 502 and kept in ``errors`` (the client's own retries then fail, and the caller raises)."""

    def __init__(self, rollout: ServerRollout, sets: KeptSets, *, timeout_s: float = 120.0) -> None:
        assert rollout.url is not None  # a started rollout
        self.rollout, self.sets, self.timeout_s = rollout, sets, timeout_s
        self.upstream = rollout.url
        self.errors: list[str] = []
        self.bodies: list[tuple[dict[str, object], SequenceRecord]] = []  # each client request and its capture
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
                pass

            def _answer(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _forward(self, method: str, body: bytes | None) -> None:
                req = urllib.request.Request(proxy.upstream + self.path, data=body, method=method,
                                             headers={"Content-Type": "application/json"})
                try:
                    with opener.open(req, timeout=proxy.timeout_s) as resp:
                        self._answer(resp.status, resp.read())
                except urllib.error.HTTPError as exc:
                    self._answer(exc.code, exc.read())

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._forward("GET", None)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.split("?")[0] != COMPLETIONS:
                    self._forward("POST", raw)
                    return
                try:
                    body = json.loads(raw)
                    payload, record = proxy.rollout.capture_request(body, spec_of_request(body))
                    proxy.sets.add(record)
                    proxy.bodies.append((body, record))
                    code, data = 200, json.dumps(payload).encode()
                except Exception as exc:  # noqa: BLE001 - answered to the client and kept for the caller
                    proxy.errors.append(f"{type(exc).__name__}: {exc}")
                    code, data = 502, json.dumps({"error": {"message": str(exc)}}).encode()
                try:
                    self._answer(code, data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (a worker stopped with requests in flight): nothing to answer

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="parity-capture-proxy", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> CaptureProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
