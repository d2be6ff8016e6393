"""What belongs to one tenant behind the door: its prefix cache and its stored responses.

* :mod:`.cache`: whether tenants share workers' prefix caches, and the ``cache_salt`` a worker
  gets for a tenant (a keyed hash: a worker's logs never show a tenant's name).
* :mod:`.secret`: the hash's key when the config names none, generated once and kept (Redis or
  a file under ``server.state_dir``) so reloads, restarts and replicas agree on every salt.
* :mod:`.owners`: which worker and tenant made each stored ``/v1/responses`` response, in
  memory or in Redis (shared by replicas), for a TTL.
"""
