"""The OpenAI-compatible HTTP server over the serving engine: `python -m hspec_jax.serve` (`__main__.py`).

protocol.py  the API's request checks (400s naming the field) and response shapes, SSE framing
worker.py    the engine thread: the only code that touches the `ServingEngine`; jobs in, tokens out
app.py       the Starlette handlers: check, encode, enqueue (429 when full), stream; a disconnect cancels
metrics.py   Prometheus metrics
"""
