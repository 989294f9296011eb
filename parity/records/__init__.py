"""The record types every engine produces (:mod:`~parity.records.sequence`) and their batching into
model input (:mod:`~parity.records.batch`)."""
