"""kvstore as SGLang's HiCache L3 vs SGLang's own HiCacheFile (bench_sglang_tier.py)."""
