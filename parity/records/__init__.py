"""The records file format (schema_version 1): its columns (schema), reading (read), writing (write), checking
(validate, arrays, casts, routed), conversion from parity's own sequences and from vLLM's outputs (convert,
vllm_outputs), and the batching of sequences into model input (batch). Judging what records hold is
:mod:`parity.judge`."""
