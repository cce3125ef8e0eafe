"""Cua-S1 (Qwen3.5-4B + the `text` LoRA) as a mixed pipeline: native vLLM backbone -> graph letter head."""
