"""The vLLM tier's tests (tests/engines/vllm_tier/) in the vLLM environment that scripts/vllm_env.sh builds.

vLLM is never part of kvstore's own install, so its tests run in their own interpreter; this test
runs them there and fails with their output. Without that environment it is skipped, unless
KVSTORE_REQUIRE_VLLM=1 (CI sets it: the tier must be tested against vLLM's real code there)."""

from __future__ import annotations

from tests.engines.engine_env import run_engine_tests


def test_the_vllm_tier_passes_against_vllms_own_offloading_code() -> None:
    run_engine_tests("vllm", "vllm_tier", "vllm_env.sh", "KVSTORE_VLLM_VENV", ".venv-vllm", "KVSTORE_REQUIRE_VLLM")
