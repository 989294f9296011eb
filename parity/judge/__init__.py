"""Judging records: per-token columns (token_columns, token_values), their streamed accumulators (accumulate,
accumulators, streams, steps), the gate table and its verdicts (gate_table, diagnosis, verdict), one scenario at
a time (scenario). The file format they read is :mod:`parity.records`."""
