"""Serving: continuous batching over our caches (`batching`), the scheduler (`engine`), the OpenAI-compatible
HTTP server (`app`), the load-test client (`bench`)."""
