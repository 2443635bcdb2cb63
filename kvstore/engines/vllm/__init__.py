"""kvstore as a secondary tier of vLLM's OffloadingConnector (``tier.py``), with the page geometry of
DeepSeek-V4.1's prefix-cacheable KV cache groups (``geometry.py``, importable without vLLM)."""
