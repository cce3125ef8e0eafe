"""Open-Jev: a Qwen backbone (native vLLM stage) scoring one prompt per candidate, and a scalar head bundle."""
