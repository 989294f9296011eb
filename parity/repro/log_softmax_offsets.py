"""The measurement of the torch_cpu_log_softmax repro: float32 ``torch.log_softmax``'s per-row offset
against float64, beside ``logsumexp``'s, and the verdict's rule. Inlined into the emitted script
(``# @inline`` in standalone_src.py), so it imports nothing from parity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

# torch reads ATEN_CPU_CAPABILITY once, when it is imported: the second kernel path runs in a child process,
# which prints one "LSM_ROW<TAB>key=value<TAB>..." line per (V, sigma). The script is its own child (LSM_CHILD set).
LSM_CHILD = "REPRO_LOG_SOFTMAX_CHILD"
LSM_ROW = "LSM_ROW"
LSM_IN_PROCESS = "in-process"
LSM_DEFAULT = "ATEN_CPU_CAPABILITY=default"
LSM_MIN_POSITIVE = 0.95  # "(nearly) every row": this share of the rows has a positive offset
LSM_MIN_RATIO = 10.0  # log_softmax's mean offset over float32 logsumexp's mean |offset|
LSM_CHUNK = 16  # rows per batch of the float64 reference (memory)
# One table row: the measured numbers, V and sigma, the capability and the fingerprint (and the script's kernel
# path); as a child prints it and the parent reads it back (lsm_value: int, then float, else the text).
LsmRow = dict[str, int | float | str]
LSM_COLUMNS = (("vocab", "V", ",d"), ("sigma", "σ", "g"), ("path", "kernel path", ""), ("capability", "torch capability", ""),
               ("rows", "rows", ""), ("ls_mean", "log_softmax mean offset", "+.2e"), ("ls_max", "max offset", "+.2e"),
               ("positive", "rows > 0", ".0%"), ("spread", "within-row spread", ".1e"),
               ("rounding", "float32 rounding spread", ".1e"), ("lse_mean", "logsumexp mean offset", "+.1e"),
               ("lse_abs", "logsumexp mean abs offset", ".1e"), ("written_mean", "max+exp+sum mean offset", "+.1e"))


def lsm_base_rows(vocab: int, rows: int, seed: int) -> torch.Tensor:
    """Standard normal rows [rows, vocab] in float32; the logits are sigma times these. Drawn in float64 and
    rounded: torch's float32 normal sampler gives other numbers on the other kernel path."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + vocab)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float64).float()


def lsm_fingerprint(z: torch.Tensor) -> int:
    """An integer fingerprint of z's bits (exact integer sums, so both kernel paths agree on equal rows)."""
    bits = z.contiguous().view(torch.int32).long()
    weights = torch.arange(z.shape[-1]) % 1021 + 1  # per row |sum| < 2^31 * 1021 * V: no int64 overflow
    return int(sum(int(s) * (i + 1) for i, s in enumerate((bits * weights).sum(-1).tolist())) % (1 << 61))


def lsm_row_offsets(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row of float32 logits z [R, V], each a float64 [R]: the offset (mean over the row's tokens of
    float32 result - float64 log_softmax) of torch.log_softmax, of z - torch.logsumexp(z) and of a written-out
    max + exp + sum; the within-row spread (std over tokens) of log_softmax's difference, and the spread of
    the float64 values rounded to float32 (what any float32 result has). A row biased by one constant has
    a mean far from 0 and a spread near that rounding spread."""
    exact = torch.log_softmax(z.double(), dim=-1)
    d = torch.log_softmax(z, dim=-1).double() - exact
    lse = (z - torch.logsumexp(z, dim=-1, keepdim=True)).double() - exact
    shifted = z - z.amax(dim=-1, keepdim=True)
    written = (shifted - shifted.exp().sum(dim=-1, keepdim=True).log()).double() - exact
    return {"log_softmax": d.mean(-1), "spread": d.std(-1), "rounding": (exact.float().double() - exact).std(-1),
            "logsumexp": lse.mean(-1), "written_out": written.mean(-1)}


def lsm_measure(vocabs: Iterable[int], scales: Iterable[float], rows: int, seed: int) -> list[LsmRow]:
    """One table row per (V, sigma) on this process's kernel path: the per-row statistics over `rows` rows."""
    capability = torch.backends.cpu.get_cpu_capability()
    out: list[LsmRow] = []
    for vocab in vocabs:
        base = lsm_base_rows(vocab, rows, seed)
        fingerprint = lsm_fingerprint(base)
        for sigma in scales:
            parts = [lsm_row_offsets(base[i : i + LSM_CHUNK] * sigma) for i in range(0, rows, LSM_CHUNK)]
            per = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            ls = per["log_softmax"]
            out.append({"vocab": int(vocab), "sigma": float(sigma), "capability": capability, "rows": int(rows),
                        "ls_mean": float(ls.mean()), "ls_max": float(ls.max()), "ls_min": float(ls.min()),
                        "positive": float((ls > 0).double().mean()), "spread": float(per["spread"].mean()),
                        "rounding": float(per["rounding"].mean()), "lse_mean": float(per["logsumexp"].mean()),
                        "lse_abs": float(per["logsumexp"].abs().mean()),
                        "written_mean": float(per["written_out"].mean()), "fingerprint": fingerprint})
    return out


def lsm_print(rows: Iterable[Mapping[str, object]]) -> None:
    """The child's output: one tab-separated line per table row."""
    for r in rows:
        print("\t".join([LSM_ROW] + [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()]),
              flush=True)


def lsm_value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def lsm_parse(stdout: str) -> list[LsmRow]:
    """The table rows a child printed (lsm_print's lines; other output is ignored)."""
    rows: list[LsmRow] = []
    for line in stdout.splitlines():
        if line.startswith(LSM_ROW + "\t"):
            rows.append({k: lsm_value(v) for k, v in (item.split("=", 1) for item in line.split("\t")[1:])})
    return rows


def _number(v: object) -> float:
    """A measured number of a row (an int or a float, from lsm_measure or read back as JSON or by lsm_parse)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"not a measured number: {v!r}")
    return v


def lsm_checks(rows: Sequence[Mapping[str, object]], vocab: int, scale: float, child_error: str = "") -> list[tuple[str, bool, str]]:
    """The verdict's rule, as (statement, holds, detail): the default-path rows come from torch's DEFAULT
    kernels; then on each kernel path, at V = `vocab` and logit scale `scale`, log_softmax's row offset is
    positive on at least LSM_MIN_POSITIVE of the rows and its mean is positive and at least LSM_MIN_RATIO
    times float32 logsumexp's mean |offset| over the same rows. A row that was not measured fails."""
    child = [r for r in rows if r["path"] == LSM_DEFAULT]
    caps = sorted({str(r["capability"]) for r in child})
    checks = [(f"the subprocess with {LSM_DEFAULT} ran torch's DEFAULT (non-vectorised) kernels",
               bool(child) and caps == ["DEFAULT"],
               f"capability {', '.join(caps)}" if child else f"no rows: {child_error or 'the subprocess printed none'}")]
    for path in (LSM_IN_PROCESS, LSM_DEFAULT):
        statement = (f"{path}, V={vocab:,}, sigma={scale:g}: log_softmax's offset is positive on >= "
                     f"{LSM_MIN_POSITIVE:.0%} of rows and its mean is >= {LSM_MIN_RATIO:g}x float32 logsumexp's mean |offset|")
        pick = [r for r in rows if r["path"] == path and r["vocab"] == vocab and r["sigma"] == scale]
        if not pick:
            checks.append((statement, False, "not measured"))
            continue
        r = pick[0]
        ls_mean, lse_abs, positive = (_number(r[k]) for k in ("ls_mean", "lse_abs", "positive"))
        ratio = ls_mean / lse_abs if lse_abs > 0 else math.inf
        ok = positive >= LSM_MIN_POSITIVE and ls_mean > 0 and ls_mean >= LSM_MIN_RATIO * lse_abs
        checks.append((statement, ok, f"{r['capability']}: mean {ls_mean:+.2e}, positive on {positive:.0%} of "
                                      f"{r['rows']} rows; logsumexp mean |offset| {lse_abs:.1e} (ratio {ratio:.1f})"))
    return checks
