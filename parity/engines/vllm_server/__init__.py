"""Rollout side over HTTP: the wire format (:mod:`~parity.engines.vllm_server.protocol`), the spawned
server's process (:mod:`~parity.engines.vllm_server.process`) and the client that samples through it
(:mod:`~parity.engines.vllm_server.client`)."""
