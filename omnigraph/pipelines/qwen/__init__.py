"""Shared pieces of the Qwen-backbone pipelines (Cua-S1, Open-Jev): the tiny Qwen3 synthesiser."""
