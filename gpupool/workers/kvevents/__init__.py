"""What each vLLM worker's prefix cache holds, from vLLM's own KV-cache events.

vLLM (``--kv-events-config``) publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
batches over ZMQ PUB with sequence numbers, and keeps the last batches for a replay socket.
Here, per worker: a subscription thread (``subscriber.py``) decodes them (``wire.py``) into a
bounded index (``index.py``); ``render.py`` and ``hashing.py`` compute a request's token ids
and its blocks' hashes the way vLLM does, so the gateway can name them before the worker has
seen the request; ``pool.py`` keeps one subscription per worker and empties a worker's index
when its cache is gone (restart, sleep, wake, stop); ``publisher.py`` speaks vLLM's side of
the protocol (the simulator's, and tests').
"""
