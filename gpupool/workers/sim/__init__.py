"""A vLLM 0.32 stand-in for tests, benchmarks and GPU-less development.

``config.SimConfig`` describes one worker; ``app.create_sim_app`` builds its ASGI app and
``app.run_sim`` serves it with uvicorn; ``cli.sim`` is the ``gpupool sim`` command.
"""
