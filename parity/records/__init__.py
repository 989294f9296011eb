"""The record types every engine produces (:mod:`~parity.core.sequence`, in the core layer) and their batching into
model input (:mod:`~parity.records.batch`)."""
