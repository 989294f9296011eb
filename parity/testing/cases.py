"""Random test cases for the reference filters: plans, logits and the branches a case reaches.
:class:`CasePlan` describes a batch (vocabulary, per-row spec, logit scale, planted ties and ``-inf`` entries);
:func:`build_case` makes its float32 logits deterministically. The Hypothesis strategies and
:func:`random_plan` draw the same plans, so ``parity sampler`` and the test-suite share their inputs."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from parity.core.estimators import scale
from parity.core.filters import reference_filter
from parity.core.penalties import penalise
from parity.core.spec import SamplingSpec

NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowPlan:
    """One row of a batch: its spec and the features planted in its logits."""

    spec: SamplingSpec
    std: float = 1.0  # logits ~ N(0, std); 0.1 is flat, 20 is peaked
    quantum: float = 0.0  # > 0: round logits to multiples of this (many natural ties)
    neg_inf: float = 0.0  # fraction of tokens set to -inf (at least one stays finite)
    single_finite: bool = False  # every token -inf but one
    top_k_tie: int = 0  # this many tokens below the k-th get the k-th value (needs 1 <= top_k < V)
    top_p_tie: int = 0  # >= 2: a block of this many tied tokens with the top_p cut placed inside it
    prompt_len: int = 1  # tokens of the row's prompt (the repetition penalty reads them)
    output_len: int = 0  # tokens generated before this step (every penalty reads them)
    history_top: float = 0.5  # fraction of the history drawn from the row's ten largest logits (moves the filters)


@dataclass(frozen=True)
class CasePlan:
    vocab: int
    rows: tuple[RowPlan, ...]
    seed: int = 0  # logit noise and the sampler's per-row generators


@dataclass
class Case:
    logits: torch.Tensor  # float32 [N, V]
    specs: list[SamplingSpec]  # one per row, as the user would write them (not yet effective)
    seed: int
    plan: CasePlan | None = None
    source: str = "drawn"  # "drawn" by a generator, or "example" for hand-picked cases
    prompt_ids: list[list[int]] | None = None  # per row: the prompt (None: every row's is empty)
    output_ids: list[list[int]] | None = None  # per row: the tokens generated before this step

    @property
    def histories(self) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt_ids, output_ids), one (possibly empty) list per row."""
        n = self.logits.shape[0]
        empty: list[list[int]] = [[] for _ in range(n)]
        return self.prompt_ids or empty, self.output_ids or [list(x) for x in empty]

    def penalised_logits(self) -> torch.Tensor:
        """The logits after the penalties: what temperature and the filters see (the estimators' input)."""
        prompts, outputs = self.histories
        return penalise(self.logits, self.specs, prompts, outputs)

    def __repr__(self) -> str:
        n, v = self.logits.shape
        specs = "; ".join(s.label() for s in self.specs)
        return f"Case(N={n}, V={v}, seed={self.seed}, specs=[{specs}])"


def plant_top_k_tie(z: torch.Tensor, k: int, extra: int) -> None:
    """Give the ``extra`` tokens ranked just below the k-th the k-th value (in place, 1-D row): vLLM keeps every
    token tied with it (``apply_top_k_only`` / ``apply_top_k_top_p`` compare ``< kth``), so |S| becomes k + extra.
    Skipped when the row has fewer than k + 1 finite values (the k-th is then -inf or has no neighbour below)."""
    finite = int(torch.isfinite(z).sum())
    if extra < 1 or k >= finite:
        return
    vals, idx = z.sort(descending=True, stable=True)
    last = min(k + extra, finite)
    z[idx[k:last]] = vals[k - 1]


def plant_top_p_tie(z: torch.Tensor, spec: SamplingSpec, size: int, gen: torch.Generator) -> SamplingSpec:
    """Tie a block of ``size`` surviving tokens and move top_p so that the ascending cumsum drops exactly h of
    them (1 <= h < size), chosen by the sort order (the construction: docs/internals.md, section 10). The spec
    is returned unchanged without a block of enough mass (>= 1e-3 per token)."""
    eff = spec.effective()
    if size < 2 or eff.greedy:
        return spec
    # The tie is planted in the raw logits, before any penalty (a penalty may then move it: that case is drawn too).
    pre = reference_filter(z.unsqueeze(0), replace(eff.without_penalties(), top_p=1.0)).kept[0]
    surv = pre.nonzero().squeeze(1)
    if surv.numel() < size:
        return spec
    order = surv[z[surv].sort(descending=True, stable=True).indices]
    start = int(torch.randint(0, surv.numel() - size + 1, (1,), generator=gen))
    block = order[start : start + size]
    z[block] = float(z[block[0]])
    scaled = (z / torch.tensor(eff.temperature, dtype=torch.float32)).double()
    probs = torch.softmax(scaled.masked_fill(~pre, NEG_INF), dim=-1)
    b = float(probs[block[0]])
    below = float(probs[pre & (scaled < scaled[block[0]])].sum())
    h = int(torch.randint(1, size, (1,), generator=gen))
    top_p = 1.0 - (below + (h + 0.5) * b)
    if b < 1e-3 or not (1e-3 < top_p < 1.0 - 1e-6):
        return spec
    return replace(spec, top_p=top_p)


def build_case(plan: CasePlan) -> Case:
    """Deterministic float32 logits ``[N, V]`` for a plan (features planted in the order listed)."""
    gen = torch.Generator().manual_seed(plan.seed)
    vocab = plan.vocab
    rows: list[torch.Tensor] = []
    specs: list[SamplingSpec] = []
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    for rp in plan.rows:
        z = torch.randn(vocab, generator=gen, dtype=torch.float32) * rp.std
        if rp.quantum > 0:
            z = torch.round(z / rp.quantum) * rp.quantum
        if rp.neg_inf > 0:
            drop = torch.rand(vocab, generator=gen) < rp.neg_inf
            drop[int(torch.randint(0, vocab, (1,), generator=gen))] = False  # one stays finite
            z[drop] = NEG_INF
        if rp.single_finite:
            keep = int(torch.randint(0, vocab, (1,), generator=gen))
            value = z[keep] if torch.isfinite(z[keep]) else torch.tensor(0.0)
            z = torch.full_like(z, NEG_INF)
            z[keep] = value
        spec = rp.spec
        eff = spec.effective()
        if rp.top_k_tie and eff.uses_top_k and eff.top_k < vocab:
            plant_top_k_tie(z, eff.top_k, rp.top_k_tie)
        if rp.top_p_tie >= 2:
            spec = plant_top_p_tie(z, spec, rp.top_p_tie, gen)
        rows.append(z)
        specs.append(spec)
        prompts.append(_history(z, rp.prompt_len, rp.history_top, gen))
        outputs.append(_history(z, rp.output_len, rp.history_top, gen))
    return Case(torch.stack(rows), specs, plan.seed, plan, prompt_ids=prompts, output_ids=outputs)


def _history(z: torch.Tensor, length: int, top: float, gen: torch.Generator) -> list[int]:
    """``length`` token ids for a penalty history: a ``top`` share from the row's ten largest logits (so the
    penalties move kept sets), the rest uniform over the vocabulary; repeats are likely (frequency counts > 1)."""
    vocab = z.shape[0]
    if length < 1:
        return []
    best = z.topk(min(10, vocab)).indices
    pick_top = torch.rand(length, generator=gen) < top
    from_top = best[torch.randint(0, best.numel(), (length,), generator=gen)]
    uniform = torch.randint(0, vocab, (length,), generator=gen)
    return torch.where(pick_top, from_top, uniform).tolist()


# -- random plans (the CLI's generator; parity.testing.strategies draws the same shapes with Hypothesis)

VOCAB_CHOICES = (2, 3, 5, 8, 16, 50, 128, 257, 1000, 2048, 4096)


def random_spec(rng: random.Random, vocab: int, *, penalties: bool = True) -> SamplingSpec:
    temperature = rng.choice(
        [0.0, rng.uniform(1e-7, 9.9e-6), rng.uniform(1e-5, 0.0099), rng.uniform(0.01, 0.99), 1.0, rng.uniform(1.01, 2.0)]
    )
    top_k = rng.choice([0, -1, 1, rng.randint(2, max(2, vocab - 1)), vocab, vocab + rng.randint(1, 100)])
    top_p = rng.choice([1.0, rng.uniform(0.01, 0.3), rng.uniform(0.6, 0.99)])
    min_p = rng.choice([0.0, rng.uniform(0.01, 0.3), 1.0])
    if not penalties or rng.random() < 0.5:
        return SamplingSpec(temperature, top_k, top_p, min_p)
    return SamplingSpec(temperature, top_k, top_p, min_p, *random_penalties(rng))


def random_penalties(rng: random.Random) -> tuple[float, float, float]:
    """(repetition, presence, frequency) over vLLM's allowed ranges, each often at its neutral value."""
    rep = rng.choice([1.0, rng.uniform(1.0, 1.3), rng.uniform(0.5, 2.0), rng.uniform(0.05, 5.0)])
    presence = rng.choice([0.0, 0.0, rng.uniform(-2.0, 2.0)])
    frequency = rng.choice([0.0, 0.0, rng.uniform(-2.0, 2.0)])
    return rep, presence, frequency


def random_row(rng: random.Random, vocab: int, spec: SamplingSpec | None = None, *, penalties: bool = True) -> RowPlan:
    """``penalties=False``: no penalty and no history, drawing nothing for them (the stream of the plans drawn
    before penalties were, so a case recorded then is drawn again)."""
    row = RowPlan(
        spec=spec or random_spec(rng, vocab, penalties=penalties),
        std=rng.choice([0.1, rng.uniform(0.5, 5.0), 20.0]),
        quantum=rng.choice([0.0, 0.0, 0.0, 0.25, 1.0]),
        neg_inf=rng.choice([0.0, 0.0, 0.0, rng.uniform(0.1, 0.9)]),
        single_finite=rng.random() < 0.05,
        top_k_tie=rng.choice([0, 0, 1, rng.randint(2, 4)]),
        top_p_tie=rng.choice([0, 0, rng.randint(2, 5)]),
    )
    if not penalties:
        return replace(row, prompt_len=0, output_len=0)
    return replace(row, prompt_len=rng.choice([1, rng.randint(2, 40)]),
                   output_len=rng.choice([0, rng.randint(1, 10), rng.randint(11, 60)]),
                   history_top=rng.choice([0.0, 0.5, 0.9]))


def random_plan(rng: random.Random, *, max_vocab: int = 4096, max_rows: int = 6, penalties: bool = True) -> CasePlan:
    vocab = rng.choice([v for v in VOCAB_CHOICES if v <= max_vocab] or [max_vocab])
    n = rng.randint(1, max_rows)
    if rng.random() < 0.6:  # mixed per-row specs, as vLLM batches requests with different settings
        rows = tuple(random_row(rng, vocab, penalties=penalties) for _ in range(n))
    else:
        spec = random_spec(rng, vocab, penalties=penalties)
        rows = tuple(random_row(rng, vocab, spec, penalties=penalties) for _ in range(n))
    if rng.random() < 0.25:
        rows = without_top_p(rows)
    return CasePlan(vocab, rows, rng.randrange(2**31))


def without_top_p(rows: Sequence[RowPlan]) -> tuple[RowPlan, ...]:
    """The same rows with top_p off everywhere: the batch then takes vLLM's top_k-only path."""
    return tuple(replace(r, spec=replace(r.spec, top_p=1.0), top_p_tie=0) for r in rows)


# -- labels: which hard case a batch actually exercises, read from the data, not from the plan -----


def _logit_labels(row: torch.Tensor, finite: torch.Tensor, vocab: int) -> set[str]:
    """Labels of one row's raw logits: -inf entries, flat or peaked, ties."""
    labels: set[str] = set()
    nf = int(finite.sum())
    if nf == 1:
        labels.add("row with a single finite value")
    elif nf < vocab:
        labels.add("-inf entries")
    if nf > 1:
        std = float(row[finite].std())
        if std <= 0.5:
            labels.add("flat logits (std<=0.5)")
        elif std >= 10:
            labels.add("peaked logits (std>=10)")
        if int(torch.unique(row[finite]).numel()) < nf:
            labels.add("ties among the logits")
    return labels


def case_labels(case: Case, kept: torch.Tensor | None = None) -> set[str]:
    """Labels of the branches a case reaches; ``kept`` (vLLM's or the reference's) enables the tie labels."""
    logits = case.logits
    n, vocab = logits.shape
    eff = [s.effective() for s in case.specs]
    greedy = [s.greedy for s in eff]
    any_p = any(s.uses_top_p for s in eff)
    labels = {label for label, holds in (
        ("V<=16" if vocab <= 16 else "V<=512" if vocab <= 512 else "V>512", True),
        ("batch: all greedy", all(greedy)),
        ("batch: greedy rows among random rows", any(greedy) and not all(greedy)),
        ("batch: mixed per-row specs", len(set(eff)) > 1),
        ("batch: sort path (some row uses top_p)", any_p),
        ("batch: top_k-only path", not any_p and any(s.uses_top_k and s.top_k < vocab for s in eff)),
    ) if holds}
    pen = [s for s in eff if s.penalised]
    if pen:
        labels.add("batch: penalties (some row penalised)")
        labels |= {label for label, holds in (
            ("batch: penalised rows among unpenalised rows", len(pen) < len(eff)),
            ("penalised greedy row", any(s.greedy for s in pen)),
            ("repetition_penalty > 1", any(s.repetition_penalty > 1.0 for s in pen)),
            ("repetition_penalty < 1", any(s.repetition_penalty < 1.0 for s in pen)),
            ("presence_penalty on", any(s.presence_penalty != 0.0 for s in pen)),
            ("frequency_penalty on", any(s.frequency_penalty != 0.0 for s in pen)),
            ("a penalty moved the argmax",
             bool((case.penalised_logits().argmax(dim=-1) != logits.argmax(dim=-1)).any())),
        ) if holds}
    z_scaled = scale(case.penalised_logits(), case.specs)
    probs = torch.softmax(z_scaled, dim=-1)
    for r, (raw, s) in enumerate(zip(case.specs, eff, strict=True)):
        t = raw.temperature
        labels.add("T=0" if t == 0 else "0<T<1e-5 (vLLM raises it to 0.01)" if t < 1e-5
                   else "1e-5<=T<0.01 (raised to 0.01)" if t < 0.01 else "T<1" if t < 1 else "T=1" if t == 1 else "T>1")
        finite = torch.isfinite(logits[r])
        labels |= _logit_labels(logits[r], finite, vocab)
        if s.greedy:
            continue
        labels.add("top_k off" if not s.uses_top_k else "top_k=1" if s.top_k == 1
                   else "top_k>=V" if s.top_k >= vocab else "1<top_k<V")
        labels.add("top_p off" if not s.uses_top_p else "top_p small (<=0.3)" if s.top_p <= 0.3 else "top_p typical")
        labels.add("min_p off" if not s.uses_min_p else "min_p=1" if s.min_p == 1 else "min_p typical")
        underflow = bool(((probs[r] == 0) & finite).any())
        if underflow:
            labels.add("probabilities underflow to 0")
            if any_p and not s.uses_top_p:
                labels.add("top_p=1 row on the sort path with underflow")
        if kept is None:
            continue
        k_row = kept[r]
        if s.uses_top_k and s.top_k < vocab and int(k_row.sum()) > s.top_k:
            labels.add("tie at the top_k boundary (|S|>k)")
            if not any_p:
                labels.add("tie at the top_k boundary on the top_k-only path")
        if s.uses_top_p:
            kept_vals = torch.unique(z_scaled[r][k_row])
            dropped_vals = z_scaled[r][~k_row & finite]
            if bool(torch.isin(dropped_vals, kept_vals).any()):
                labels.add("split tie at the top_p boundary")
    return labels


# Every label the CI profile must reach (tests/sampler asserts it; `parity sampler` prints the counts).
REQUIRED_LABELS = frozenset({
    "V<=16", "V<=512", "V>512",
    "batch: all greedy", "batch: greedy rows among random rows", "batch: mixed per-row specs",
    "batch: sort path (some row uses top_p)", "batch: top_k-only path",
    "T=0", "0<T<1e-5 (vLLM raises it to 0.01)", "1e-5<=T<0.01 (raised to 0.01)", "T<1", "T=1", "T>1",
    "row with a single finite value", "-inf entries", "flat logits (std<=0.5)", "peaked logits (std>=10)",
    "ties among the logits",
    "top_k off", "top_k=1", "top_k>=V", "1<top_k<V",
    "top_p off", "top_p small (<=0.3)", "top_p typical",
    "min_p off", "min_p=1", "min_p typical",
    "probabilities underflow to 0", "top_p=1 row on the sort path with underflow",
    "tie at the top_k boundary (|S|>k)", "tie at the top_k boundary on the top_k-only path",
    "split tie at the top_p boundary",
    "batch: penalties (some row penalised)", "batch: penalised rows among unpenalised rows",
    "penalised greedy row",
    "repetition_penalty > 1", "repetition_penalty < 1", "presence_penalty on", "frequency_penalty on",
    "a penalty moved the argmax",
})
