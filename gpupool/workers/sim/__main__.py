"""``python -m gpupool.workers.sim``: the ``sim`` command on its own."""

from gpupool.workers.sim.cli import sim

if __name__ == "__main__":
    sim()
