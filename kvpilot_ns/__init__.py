"""kvpilot: memory observability and auto-tuning for vLLM."""

__version__ = "0.1.0"
