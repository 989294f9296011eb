"""The test suite's strategies are the exported ones (parity.testing.strategies), so users test with the same."""

from parity.testing.strategies import *  # noqa: F401,F403
from parity.testing.strategies import (  # noqa: F401
    case_plans,
    cases,
    example_case,
    example_logits,
    row_plans,
    specs,
    top_ks,
)
