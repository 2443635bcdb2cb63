"""kvstore as a secondary tier of vLLM's OffloadingConnector: the tier's hooks (``tier.py``), tenants and page
sessions (``sessions.py``), the bytes' movement (``transfer.py``), the daemon link (``daemon.py``), the page geometry of
DeepSeek-V4.1's prefix-cacheable KV cache groups (``geometry.py``, importable without vLLM)."""
