"""The test suite's strategies are the exported ones (parity.strategies), so users test with the same."""

from parity.strategies import *  # noqa: F401,F403
from parity.strategies import case_plans, cases, example_case, example_logits, row_plans, specs, top_ks  # noqa: F401
