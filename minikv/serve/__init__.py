"""Rung 10, serving many users: an OpenAI-compatible HTTP server over one engine loop.

    minikv serve --model smollm2-135m --port 8000 [--schedule-policy vtc] [--isolate-tenants]

app.py          the routes (FastAPI), streaming, errors, tenants; `Server` runs it on a thread
engine_loop.py  the one thread that owns the LLM; handlers submit to it and await their events
protocol.py     the OpenAI request fields, checked, and the response shapes
tenants.py      who sent a request: a keyed hash of the API key; cache salts per tenant
metrics.py      GET /metrics in Prometheus text, named as vLLM's
"""
from minikv.serve.app import Server, build_app, run
from minikv.serve.engine_loop import EngineLoop
from minikv.serve.metrics import ServerMetrics, parse_metrics

__all__ = ["Server", "build_app", "run", "EngineLoop", "ServerMetrics", "parse_metrics"]
