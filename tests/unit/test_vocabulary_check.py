"""The vocabulary check that runs before any comparison, on a real tokenizer (no engine needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from parity.engines.session import check_same_vocabulary


@dataclass
class Side:
    """What the check reads from an engine adapter: its vocabulary size and its tokenizer."""

    vocab_size: int
    tok: Any
    model: str = "m"
    model_path: str = "m"

    def tokenizer(self) -> Any:
        return self.tok


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    from parity.fixtures import resolve_model

    return transformers.AutoTokenizer.from_pretrained(resolve_model("qwen2-tiny"))


def test_a_tokenizer_larger_than_the_model_is_refused_with_both_numbers(tokenizer) -> None:
    n = len(tokenizer)
    with pytest.raises(ValueError, match=rf"tokenizer has {n} tokens but the model's vocabulary \(embedding rows\) is {n - 10}"):
        check_same_vocabulary(Side(n - 10, tokenizer), Side(n - 10, tokenizer))


def test_an_embedding_padded_past_the_tokenizer_is_accepted(tokenizer) -> None:
    n = len(tokenizer)
    check_same_vocabulary(Side(n + 64, tokenizer), Side(n + 64, tokenizer))
    check_same_vocabulary(Side(n, tokenizer), Side(n, tokenizer))
