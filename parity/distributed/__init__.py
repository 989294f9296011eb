"""Vocabulary-parallel trainer estimators: the sharded math (:mod:`~parity.distributed.sharded`) and
the process pool that runs it (:mod:`~parity.distributed.pool`)."""
