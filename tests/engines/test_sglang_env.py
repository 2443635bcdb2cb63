"""The HiCache L3 tests (tests/engines/sglang_tier/) in the SGLang environment that scripts/sglang_env.sh builds.

SGLang is never part of kvstore's own install, so its tests run in their own interpreter; this test runs them
there and fails with their output. Without that environment it is skipped, unless KVSTORE_REQUIRE_SGLANG=1 (CI
sets it: the L3 backend must be tested against SGLang's real HiCache code there)."""

from __future__ import annotations

from tests.engines.engine_env import run_engine_tests


def test_the_hicache_l3_scenarios_pass_against_sglangs_own_hicache_code() -> None:
    run_engine_tests("SGLang", "sglang_tier", "sglang_env.sh", "KVSTORE_SGLANG_VENV", ".venv-sglang",
                     "KVSTORE_REQUIRE_SGLANG")
