"""Precise prefix routing: a request's blocks as vLLM will hash them, looked up in each worker's
index of cached blocks (``workers/kvevents``: its ``render.py`` turns a body into the token ids
vLLM will see); ``predict.py`` hashes them and asks the indexes, off the event loop."""
