"""kvstore: a tiered store for the FP4 global KV of DeepSeek-V4.1-Flash-style models."""

from __future__ import annotations

__version__ = "0.1.0"
