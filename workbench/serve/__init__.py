"""OpenAI-compatible HTTP server (``workbench serve``): one engine loop in a background thread, FastAPI
handlers that stream its tokens, Prometheus metrics under vLLM's names."""
