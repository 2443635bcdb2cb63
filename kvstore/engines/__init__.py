"""Engine integrations. Nothing in kvstore imports these; each engine's module is loaded by the
engine itself (vLLM: ``kvstore.engines.vllm.tier`` through its OffloadingConnector's tier config)."""
