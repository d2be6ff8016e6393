"""Every Redis key (and the one pub/sub channel) the Redis admission backend uses.

All names start with ``<prefix>:`` (``queue.redis_prefix``). The Lua scripts build the same names
through :func:`lua_key_table`, generated from the one table below, so a name is spelled once.
``<iid>`` is an admission id ``<replica id>|<n>`` (unique per acquire, unlike the client's ticket
id); a waiter's *member* is its order key ``fairness.encode_key(...)``, which ends with its iid.

==================  =======  ======================================================================
key                 type     contents
==================  =======  ======================================================================
``seq``             string   arrival counter (``INCR``), the last part of every order key
``t:<iid>``         hash     one ticket: ``model tenant prio rep tid enq``, + ``key cands`` while
                             waiting, + ``w`` (the worker) once granted. A waiting ticket has no
                             TTL (it leaves by grant, withdraw or the dead-replica sweep); a
                             granted one expires with its lease and is renewed with it
``q:<model>``       zset     the model's waiting tickets, all score 0, members ordered by key:
                             depth is ``ZCARD``, a position is ``ZRANK + 1``
``w:<worker>``      zset     the same members for each waiter whose candidates include the
                             worker: the head is the best eligible waiter for a freed slot
``s:<worker>``      zset     slots held on the worker: member iid, score = lease expiry (ms,
                             Redis ``TIME``); expired members are purged before counting, so a
                             dead replica's slots come back within ``lease_ttl_s``
``fair:<model>``    hash     SFQ state: ``v:<prio>`` virtual clock, ``f:<prio>:<tenant>`` finish
                             tag, ``n:<prio>:<tenant>`` waiting count (both dropped at 0);
                             ``t:<tenant>`` the tenant's waiting count, all priorities (its
                             share of the queue, ``max_queued_per_tenant``; dropped at 0)
``rate:<model>``    hash     drain rate: ``r`` grants/s at time ``t`` (ms), decayed on read
``seen:<model>``    zset     tenants that asked for a slot lately: score = when (ms); older than
                             ``reserve_window_s`` dropped at the next acquire (reserved seats)
``replicas``        zset     live replicas: member replica id, score = heartbeat expiry (ms)
``rt:<replica>``    set      iids of that replica's waiting tickets (for the dead-replica sweep)
``models``          set      models that ever had a queue (for snapshots)
``workers``         set      workers that ever had a slot (for snapshots)
``wake:<replica>``  channel  pub/sub: ``"<iid> <worker>"`` when one of its tickets is granted
==================  =======  ======================================================================
"""

from __future__ import annotations

# name -> tag; the key is "<prefix>:<tag><arg>" (no arg for singletons). The one spelling.
_TAGS: dict[str, str] = {
    "seq": "seq",
    "ticket": "t:",
    "queue": "q:",
    "waiters": "w:",
    "slots": "s:",
    "fair": "fair:",
    "rate": "rate:",
    "seen": "seen:",
    "replicas": "replicas",
    "replica_tickets": "rt:",
    "models": "models",
    "workers": "workers",
    "wake": "wake:",
}


class Keys:
    """Key names under one prefix (see the module docstring for what each holds)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _key(self, name: str, arg: str = "") -> str:
        return f"{self.prefix}:{_TAGS[name]}{arg}"

    def seq(self) -> str:
        """Arrival counter."""
        return self._key("seq")

    def ticket(self, iid: str) -> str:
        """Hash of one ticket."""
        return self._key("ticket", iid)

    def queue(self, model: str) -> str:
        """Zset of a model's waiters, in order."""
        return self._key("queue", model)

    def waiters(self, worker: str) -> str:
        """Zset of the waiters eligible for a worker, in order."""
        return self._key("waiters", worker)

    def slots(self, worker: str) -> str:
        """Zset of leases on a worker, scored by expiry."""
        return self._key("slots", worker)

    def fair(self, model: str) -> str:
        """Hash of a model's fair-queueing tags."""
        return self._key("fair", model)

    def rate(self, model: str) -> str:
        """Hash of a model's drain rate."""
        return self._key("rate", model)

    def seen(self, model: str) -> str:
        """Zset of the tenants that asked for a slot of a model lately."""
        return self._key("seen", model)

    def replicas(self) -> str:
        """Zset of replica heartbeats."""
        return self._key("replicas")

    def replica_tickets(self, replica: str) -> str:
        """Set of a replica's waiting tickets."""
        return self._key("replica_tickets", replica)

    def models(self) -> str:
        """Set of models seen."""
        return self._key("models")

    def workers(self) -> str:
        """Set of workers seen."""
        return self._key("workers")

    def wake(self, replica: str) -> str:
        """Pub/sub channel of a replica's grants."""
        return self._key("wake", replica)


def lua_key_table() -> str:
    """Lua defining ``K.<name>(arg)`` for every key, with the prefix taken from ``ARGV[1]``."""
    lines = ["local P = ARGV[1]", "local K = {}"]
    for name, tag in _TAGS.items():
        lines.append(f"K.{name} = function(a) return P .. ':{tag}' .. (a or '') end")
    return "\n".join(lines) + "\n"
