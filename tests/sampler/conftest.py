"""Sampler-level fixtures: one vLLM Sampler per session, one torch thread per test.

Why one thread: these tests push thousands of small tensors ([<=6, <=4096]) through torch. With two
intra-op threads on the 2-core CI machine, OpenMP synchronisation dominated: 150 cases took 11.4 s of
CPU (33 s wall under load) against 0.6 s (1.2 s wall) with one thread. The reference and vLLM run in
the same process under the same setting, so the comparison is unaffected. The previous thread count
is restored after each test, so tests elsewhere (the real engine) keep theirs.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def sampler():
    from parity.engines.vllm_sampler import VllmSampler

    return VllmSampler()


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
