"""The OpenAI-compatible HTTP server (`python -m runtime.serve`): see docs/serving.md."""
