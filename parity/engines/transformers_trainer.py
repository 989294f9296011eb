"""Trainer side: a transformers ``AutoModelForCausalLM`` scoring prompt + completion."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from parity.core.sequence import SequenceRecord
from parity.errors import PathNotFound, SetupError, UsageError
from parity.records.batch import right_pad

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransformersTrainer:
    """Computes logits at the completion positions, as an RL trainer does before its loss."""

    name = "trainer"

    def __init__(self, model: str | Path, *, dtype: str = "float32", device: str = "cpu", batch_size: int = 8) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model)
        if not (path / "config.json").is_file():
            raise PathNotFound(f"model path {str(model)!r} has no config.json: allowed a Hugging Face checkpoint directory")
        if device == "cuda" and not torch.cuda.is_available():
            raise SetupError("device='cuda' requested but torch.cuda.is_available() is False")
        self.model_path = str(path)
        self.dtype = dtype
        self.device = torch.device(device)
        self.batch_size = batch_size
        if dtype not in DTYPES:
            raise UsageError(f"dtype={dtype!r} is invalid: allowed {', '.join(DTYPES)}")
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=DTYPES[dtype])
        # transformers' wrapper around PreTrainedModel.to is annotated without its bound self.
        self.model.to(self.device).eval()  # type: ignore[arg-type]
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])  # type: ignore[no-untyped-call]  # unannotated in transformers

    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @torch.no_grad()
    def logits(self, records: Sequence[SequenceRecord]) -> list[torch.Tensor]:
        """float32 logits ``[L, V]`` predicting each completion token, one tensor per record. Sequences are
        right-padded into batches, which the default ``sdpa`` attention on CPU does not keep bitwise
        (docs/batch_invariance.md, section 1)."""
        out: list[torch.Tensor] = []
        for b in range(0, len(records), self.batch_size):
            chunk = records[b : b + self.batch_size]
            ids, mask = right_pad([r.prompt_ids + r.completion_ids for r in chunk])
            logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            for i, r in enumerate(chunk):
                p, n = len(r.prompt_ids), r.length
                # Position p - 1 + t predicts completion token t.
                rows = logits[i, p - 1 : p - 1 + n].float().cpu()
                if torch.isnan(rows).any():
                    t = int(torch.isnan(rows).any(dim=-1).nonzero()[0])
                    raise UsageError(f"trainer logits are NaN at prompt {r.prompt_index}, completion position {t}: "
                                     f"allowed finite logits (check the model weights and dtype={self.dtype})")
                out.append(rows)
        return out
