"""OpenAI-compatible HTTP server for the onecat engine (`onecat serve MODEL`).

One engine thread owns the LLM (the engine is single-threaded); HTTP handlers talk to it through a
thread-safe command queue and receive per-request updates on asyncio queues. See app.py for the
routes, async_engine.py for the engine thread, metrics.py for the Prometheus names.
"""
