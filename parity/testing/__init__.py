"""Testing with parity: Hypothesis strategies (:mod:`~parity.testing.strategies`), random cases
(:mod:`~parity.testing.cases`) and the properties they must satisfy (:mod:`~parity.testing.properties`),
the pytest plugin (:mod:`~parity.testing.pytest_plugin`) and the assertion helpers for a trainer under
test (:mod:`~parity.testing.asserts`)."""
