"""kvstore as a secondary tier of vLLM's OffloadingConnector: the tier's hooks (``tier.py``), requests'
tenants and page sessions (``sessions.py``, on ``kvstore/engines/pages/``), the bytes' movement
(``transfer.py``), the page geometry of DeepSeek-V4.1's prefix-cacheable KV cache groups (``geometry.py``,
importable without vLLM)."""
