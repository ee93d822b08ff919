"""`compiled-mtp serve`: an OpenAI-compatible HTTP server over a Runtime (the serve extra).

protocol.py  request bodies (pydantic)      engine.py   the thread that owns and steps the Runtime
chat.py      chat templates (Jinja2)        metrics.py  Prometheus series
app.py       routes, errors, authorization and the draining uvicorn server
"""
