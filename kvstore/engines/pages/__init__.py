"""What every engine integration shares: tenants and page sessions (``sessions.py``) and the link to the
daemon that turns an unreachable one into misses (``daemon.py``). Importable without any engine."""
