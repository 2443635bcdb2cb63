"""kvstore as SGLang's HiCache L3 for DeepSeek-V4.1: the multi-pool (v2) storage backend SGLang loads
dynamically (``backend.py``), its host pools as regions of slots (``host.py``), the page geometry of
its V4.1 pools (``geometry.py``, importable without SGLang). Tenants, page sessions and the daemon link
are the engines' shared ones (``kvstore/engines/pages/``)."""
