"""One run of TRL's asynchronous trainer at step 0, every sampling setting, in its own process:
``python -m parity.repro.trl_async_run --config JSON --out DIR`` writes DIR/result.json.

Per setting: TRL's rollout worker through parity's capture proxy, TRL's collator, and TRL's ``compute_loss``
twice on the same batch, as shipped and under the replay patch (and, with ``plant``, under a replay of the wrong
step's kept sets). The logged per-token tensors are written as records and judged by ``parity analyze``'s code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PROMPTS = (
    "The sampler and the trainer must agree on",
    "Write one sentence about rivers and",
    "List three colours that",
    "Once upon a time a small robot",
)
FLOAT32_U = 2.0**-24


def _records(samples: list[Any], inputs: dict[str, Any], trainer: Any, spec: Any, meta: dict[str, object],
             path: Path) -> dict[str, object]:
    """The async trainer's per-token logs (old_log_probs, the trainer's log_probs) as records, judged as
    ``parity analyze`` judges a file."""
    from parity.analyze.report import analyze
    from parity.engines.trl_async import per_sample
    from parity.records.write import write_records

    sel = inputs["token_index"][0] >= 0
    old = per_sample(inputs, inputs["old_log_probs"][0][sel])
    new = per_sample(inputs, trainer)
    rows = []
    for i, s in enumerate(samples):
        m = s.completion_mask.astype(bool)
        ids = s.input_ids.tolist()
        first = int(m.argmax())
        rows.append({"prompt_index": i, "step": 0, "prompt_ids": ids[:first],
                     "completion_ids": [t for t, k in zip(ids, m.tolist(), strict=True) if k],
                     **spec.to_dict(),
                     "sampler_logprobs": old[i].float().tolist(), "trainer_logprobs": new[i].double().tolist()})
    write_records(path, rows, metadata=meta)
    report = analyze(path, plots=False, out=None)
    (scenario,) = report["scenarios"]
    tut: dict[str, Any] = dict(scenario.get("trainer_under_test") or {})
    mb: dict[str, Any] = dict((scenario.get("mean_bias") or {}).get("logprob") or {})
    failed = sorted({v["gate"] for v in scenario.get("violations", [])})
    return {"verdict": scenario["verdict"], "diagnosis": tut.get("diagnosis"), "failed": failed,
            "mean_bias": mb.get("mean"), "limit": mb.get("limit")}


def _widening_unchanged(proxy: Any, n: int) -> dict[str, float]:
    """Send up to ``n`` of TRL's own request bodies again, unwidened, straight to the server: the same seed must
    draw the same tokens with the same log-probs as the widened answer TRL received."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    checked = same = 0
    worst = 0.0
    for body, record in proxy.bodies[:n]:
        # parity's server skips tokenizer init, so ids are asked as ids (TRL reads token_ids either way).
        plain = {**body, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(proxy.upstream + "/v1/completions", data=json.dumps(plain).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with opener.open(req, timeout=proxy.timeout_s) as resp:
            choice = json.loads(resp.read())["choices"][0]
        checked += 1
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if list(choice["token_ids"]) == list(record.completion_ids):
            same += 1
            worst = max(worst, max((abs(a - b) for a, b in zip(lps, record.logprobs.tolist(), strict=True)), default=0.0))
    # Same seed, same tokens; the log-probs may move by batch-dependent float32 rounding (the server batches
    # the widened requests with others), reported as the largest difference.
    return {"checked": checked, "same_tokens": same, "max_logprob_diff": worst}


def collect_setting(rollout: Any, tokenizer: Any, setting: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """TRL's rollout worker for one setting, through its own capture proxy: the samples and the kept sets."""
    from parity.core.spec import SamplingSpec
    from parity.engines.trl_async import collect_rollouts
    from parity.engines.vllm_server.capture_proxy import CaptureProxy, KeptSets

    t0 = time.perf_counter()
    spec = SamplingSpec.from_dict({"temperature": cfg["temperature"], **setting})
    sets = KeptSets()
    with CaptureProxy(rollout, sets, timeout_s=cfg["timeout_s"]) as proxy:
        samples = collect_rollouts(url=proxy.url, served_model=rollout.served_model, tokenizer=tokenizer,
                                   prompts=PROMPTS[: cfg["prompts"]], spec=spec, num_generations=cfg["num_generations"],
                                   max_tokens=cfg["max_tokens"], timeout_s=cfg["timeout_s"])
        if proxy.errors:
            raise RuntimeError(f"capture proxy: {proxy.errors[0]}")
        widening = _widening_unchanged(proxy, cfg["widening_checks"])
    return {"setting": setting, "spec": spec, "sets": sets, "samples": samples, "widening": widening,
            "seconds": time.perf_counter() - t0}


def run_setting(policy: Any, tokenizer: Any, got: dict[str, Any], cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    """TRL's collator and compute_loss on one setting's samples: shipped, replayed, and (``plant``) replayed with
    the wrong step's kept sets; the drift bound, and the logs judged as records."""
    import torch

    from parity.core.error_model import logprob_bound
    from parity.core.estimators import ids_to_mask
    from parity.engines.trl_async import KeptSetReplay, at_tokens, pack, trl_compute_loss
    from parity.engines.vllm_server.capture_proxy import KeptSets

    t0 = time.perf_counter()
    setting, spec, sets, samples, widening = (got[k] for k in ("setting", "spec", "sets", "samples", "widening"))
    inputs = pack(samples, tokenizer.pad_token_id)
    eps = {"epsilon": cfg["epsilon"], "epsilon_high": cfg["epsilon_high"]}
    sel = inputs["token_index"][0] >= 0
    token_index = inputs["token_index"][0][sel]
    adv = inputs["advantages"][0][sel]
    old = inputs["old_log_probs"][0][sel]

    res: dict[str, Any] = {"setting": setting, "spec": dataclasses.asdict(spec)}
    runs = {"shipped": (sets, "observe"), "fixed": (sets, "replay")}
    if cfg.get("plant"):
        wrong = KeptSets(shift=1)
        for r in sets.records:
            wrong.add(r)
        runs["planted"] = (wrong, "replay")
    tok: dict[str, Any] = {}
    for name, (kept_sets, mode) in runs.items():
        patch = KeptSetReplay(policy, kept_sets, spec, mode=mode)
        loss, metrics = trl_compute_loss(patch, inputs, **eps)
        assert patch.last is not None
        at = at_tokens(patch.last, token_index)
        if name == "shipped":
            tok = at
        new = at["full"] - (at["log_s"] if mode == "replay" else 0.0)
        res[name] = {"metrics": metrics, "loss": loss,
                     "low_clipped_tokens": int(((new - old).exp() < 1 - cfg["epsilon"]).logical_and(adv < 0).sum())}
    # Per-token drift bound between the server's and the trainer's log-prob.
    z = tok["scaled_logits"]
    bound = logprob_bound(z, tok["labels"], ids_to_mask(tok["kept"], z.shape[1]) if "kept" in tok else None,
                          dtype=cfg["trainer_dtype"])
    m = int(token_index.numel())
    s = tok["log_s"].double().exp()
    d_shipped = (tok["full"].double() - old.double()) - tok["log_s"].double()
    res.update({
        "tokens": m, "sequences": len(samples),
        "negative_advantage_tokens": int((adv < 0).sum()), "positive_advantage_tokens": int((adv > 0).sum()),
        "mean_s": float(s.mean()), "min_s": float(s.min()), "max_s": float(s.max()),
        "mean_log_s": float(tok["log_s"].double().mean()),
        "tokens_below_clip": int((s < 1 - cfg["epsilon"]).sum()),
        # The shipped ratio is S e^d with |d| <= the drift bound: a negative-advantage token is clipped for sure
        # where S e^bound < 1 - epsilon, and may be where S e^-bound < 1 - epsilon (rounding decides at the edge).
        "clipped_surely": int(((s * bound.double().exp()) < 1 - cfg["epsilon"]).logical_and(adv < 0).sum()),
        "clipped_possibly": int(((s * (-bound.double()).exp()) < 1 - cfg["epsilon"]).logical_and(adv < 0).sum()),
        # |mean exp(d) - mean exp(log S + d')|: each token moves by at most expm1(bound); TRL sums M float32 ratios.
        "resolution": float(torch.expm1(bound).mean()) + m * FLOAT32_U,
        "shipped_headroom": float((d_shipped.abs() / bound).max()),
        "largest_support": int((tok["kept"] >= 0).sum(dim=1).max()) if "kept" in tok else None,
        "capture": {"requests": len(sets.records), "incomplete": sets.incomplete, "widening": widening},
    })
    meta = {"sampler": "vLLM server (TRL AsyncRolloutWorker)", "dtype": cfg["dtype"],
            "trainer_dtype": cfg["trainer_dtype"], "vocab_size": int(tok["scaled_logits"].shape[1])}
    name = "_".join(f"{k}{v:g}" for k, v in setting.items()) or "default"
    res["records"] = {"shipped": _records(samples, inputs, tok["full"], spec, meta, out / f"{name}_shipped.parquet"),
                      "fixed": _records(samples, inputs, tok["full"] - tok["log_s"], spec, meta,
                                        out / f"{name}_fixed.parquet")}
    res["seconds"] = round(time.perf_counter() - t0 + got["seconds"], 1)
    return res


def main(cfg: dict[str, Any], out: Path) -> dict[str, Any]:
    from parity.engines.trl_async import chat_tokenizer, config_defaults, load_policy, trl_serve_flags
    from parity.engines.vllm_server.client import ServerRollout
    from parity.fixtures import resolve_model

    path = resolve_model(cfg["model"])
    defaults = config_defaults()
    cfg = {"epsilon": defaults["epsilon"], "epsilon_high": defaults["epsilon_high"],
           "temperature": defaults["temperature"], **cfg}
    flags = trl_serve_flags(path)
    result: dict[str, Any] = {"config": cfg, "trl_defaults": defaults, "trl_serve_flags": flags, "settings": []}
    tokenizer, template_note = chat_tokenizer(path)
    result["template_substitution"] = template_note
    policy = load_policy(path, temperature=cfg["temperature"])
    rollout = ServerRollout(path, server=cfg.get("server", "spawn"), dtype=cfg["dtype"], seed=cfg["seed"],
                            timeout_s=cfg["timeout_s"], max_model_len=cfg["max_model_len"])
    try:
        result["server_command"] = list(rollout.proc.args) if rollout.proc is not None else None  # type: ignore[arg-type]
        # Every setting's worker runs at once (each its own proxy and process; the server batches them): on a
        # loaded machine the rollouts, not the loss, take the time.
        print(f"trl_async_run: rollouts for {cfg['settings']}", file=sys.stderr, flush=True)
        with ThreadPoolExecutor(max_workers=max(1, len(cfg["settings"]))) as pool:
            futures = [pool.submit(collect_setting, rollout, tokenizer, s, cfg) for s in cfg["settings"]]
            collected = [f.result() for f in futures]
        for got in collected:
            print(f"trl_async_run: compute_loss for {got['setting']}", file=sys.stderr, flush=True)
            result["settings"].append(run_setting(policy, tokenizer, got, cfg, out))
            (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    finally:
        rollout.close()
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        res = main(json.loads(a.config), out_dir)
        res["done"] = True
        (out_dir / "result.json").write_text(json.dumps(res, indent=1, default=str))
    except Exception:
        traceback.print_exc()
        (out_dir / "error.txt").write_text(traceback.format_exc())
        sys.exit(1)
    sys.exit(0)
