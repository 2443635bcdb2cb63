"""Engine integrations. Nothing in kvstore imports these; each engine's module is loaded by the
engine itself (vLLM: ``kvstore.engines.vllm.tier`` through its OffloadingConnector's tier config;
SGLang: ``kvstore.engines.sglang.backend`` as a dynamic HiCache storage backend). ``pages/`` is what
both share: tenants, page sessions, the daemon link."""
