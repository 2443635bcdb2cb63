"""tests/engines/sglang_tier runs in the SGLang environment only (scripts/sglang_env.sh builds it;
tests/engines/test_sglang_env.py runs this folder there). In any other interpreter its tests are not collected."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("sglang") is not None else ["test_*.py", "harness.py"]
