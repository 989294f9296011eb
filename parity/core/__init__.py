"""The engine-free math core: tensors in, tensors out; no vLLM or transformers import (what each module
holds: docs/internals.md, section 1)."""
