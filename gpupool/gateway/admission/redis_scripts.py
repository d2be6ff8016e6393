"""The Lua scripts of the Redis admission backend, and :class:`Store`, their typed caller.

Every state change is one script, so it is atomic. Each script is the shared library
(``_LIB``: key names, Redis ``TIME``, ticket parsing, fair queueing, reserved seats, grants,
dispatch) followed by a short body. Arguments common to all: ``ARGV[1]`` key prefix, ``ARGV[2]``
lease TTL (ms), ``ARGV[3]`` drain-rate tau (ms), ``ARGV[4]`` reserved slots per worker,
``ARGV[5]`` the reserve's activity window (ms); the body's own arguments follow from
``ARGV[6]``. Keys are built inside the scripts (``keys.lua_key_table``), so this targets a single
Redis server, not Redis Cluster.

``dispatch(worker, cap)`` is the heart: purge expired leases, then while the worker has room hand
the slot to the first member of ``w:<worker>`` that may take it (skipping stale members and tickets
of dead replicas; a tenant at its limit while others are active may not, nor one at its shared
limit while another tenant runs on the worker, see ``fairness``: then the next member is looked at,
``RESERVE_SCAN`` deep at most), recording the lease and publishing ``"<iid> <worker>"`` on the
owner's ``wake:`` channel. Every script that can free a slot or add a waiter ends in it, so no slot
idles while a live eligible waiter exists, as far as the caller's view of capacity and availability
goes (a worker's capacity arrives as an argument; 0 means "not available here").

Scripts: ``acquire`` (idempotent: replaying it returns the same outcome), ``release`` (returns
the grants it caused, so the caller wakes its own waiters without the pub/sub echo), ``withdraw``
(a waiter leaves: removed, or tells it was granted meanwhile), ``recheck`` (the safety net:
dispatch some workers, report the state of some tickets), ``renew`` (heartbeat, re-assert held
leases, sweep dead replicas, list own waiting tickets), ``forget`` (drop orphaned tickets),
``retire`` (a replica's clean exit), ``snapshot`` (JSON for ``/admin/queue``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from gpupool.config.models import QueueConfig
from gpupool.gateway.admission.connection import REDIS_FAILURES, store_error
from gpupool.gateway.admission.fairness import (
    PRIORITY_LIMIT,
    RATE_TAU_S,
    RESERVE_SCAN,
    clamp_priority,
)
from gpupool.gateway.admission.keys import lua_key_table

_LIB = (
    lua_key_table()
    + """
local TTL = tonumber(ARGV[2])
local TAU = tonumber(ARGV[3])
local RESERVE = tonumber(ARGV[4])
local SCAN = RESERVE_SCAN
local WINDOW = tonumber(ARGV[5])
local T = redis.call('TIME')
local NOW = tonumber(T[1]) * 1000 + math.floor(tonumber(T[2]) / 1000)

local function split(s)
  local out = {}
  for x in string.gmatch(s or '', '[^,]+') do out[#out + 1] = x end
  return out
end

local function ticket(iid)
  local v = redis.call('HMGET', K.ticket(iid), 'model', 'tenant', 'prio', 'key', 'cands', 'rep',
    'w', 'enq')
  if not v[1] then return nil end
  return {iid = iid, model = v[1], tenant = v[2], prio = v[3], key = v[4], cands = v[5],
    rep = v[6], w = v[7], enq = v[8]}
end

local function rate_now(model)
  local v = redis.call('HMGET', K.rate(model), 'r', 't')
  local r = tonumber(v[1]) or 0
  local t = tonumber(v[2]) or NOW
  return r * math.exp(-(NOW - t) / TAU)
end

local function rate_tick(model)
  redis.call('HSET', K.rate(model), 'r', tostring(rate_now(model) + 1000 / TAU), 't', NOW)
end

local function heartbeat(rep)
  redis.call('ZADD', K.replicas(), NOW + TTL, rep)
end

local function alive(rep)
  local e = tonumber(redis.call('ZSCORE', K.replicas(), rep))
  return e ~= nil and e >= NOW
end

local function held(worker)
  redis.call('ZREMRANGEBYSCORE', K.slots(worker), '-inf', '(' .. NOW)
  return redis.call('ZCARD', K.slots(worker))
end

local function unqueue(h)
  redis.call('ZREM', K.queue(h.model), h.key)
  for _, w in ipairs(split(h.cands)) do redis.call('ZREM', K.waiters(w), h.key) end
  redis.call('SREM', K.replica_tickets(h.rep), h.iid)
  local f, n = K.fair(h.model), 'n:' .. h.prio .. ':' .. h.tenant
  if redis.call('HINCRBY', f, n, -1) <= 0 then
    redis.call('HDEL', f, n, 'f:' .. h.prio .. ':' .. h.tenant)
  end
  local t = 't:' .. h.tenant
  if redis.call('HINCRBY', f, t, -1) <= 0 then redis.call('HDEL', f, t) end
end

local function drop(h)
  unqueue(h)
  redis.call('DEL', K.ticket(h.iid))
end

local COUNTS = {}  -- worker -> tenant -> slots held, counted once per call when first needed

local function tenant_held(worker, tenant)
  local c = COUNTS[worker]
  if not c then
    c = {}
    for _, iid in ipairs(redis.call('ZRANGE', K.slots(worker), 0, -1)) do
      local t = redis.call('HGET', K.ticket(iid), 'tenant') or ''
      c[t] = (c[t] or 0) + 1
    end
    COUNTS[worker] = c
  end
  return c[tenant] or 0
end

local function saw(model, tenant)
  if RESERVE <= 0 then return end
  redis.call('ZADD', K.seen(model), NOW, tenant)
  redis.call('ZREMRANGEBYSCORE', K.seen(model), '-inf', '(' .. (NOW - WINDOW))
end

local function others_active_now(model, tenant)
  local recent = redis.call('ZRANGEBYSCORE', K.seen(model), NOW - WINDOW, '+inf', 'LIMIT', 0, 2)
  for _, t in ipairs(recent) do if t ~= tenant then return true end end
  for _, f in ipairs(redis.call('HKEYS', K.fair(model))) do
    if string.sub(f, 1, 2) == 't:' and string.sub(f, 3) ~= tenant then return true end
  end
  return false
end

local ACTIVE = {}  -- model .. '|' .. tenant -> others_active, once per call

local function others_active(model, tenant)
  local k = model .. '|' .. tenant
  if ACTIVE[k] == nil then ACTIVE[k] = others_active_now(model, tenant) end
  return ACTIVE[k]
end

-- does another tenant than this one hold a slot of worker? (COUNTS[worker] filled first)
local function others_here(worker, tenant)
  for t, c in pairs(COUNTS[worker]) do if t ~= tenant and c > 0 then return true end end
  return false
end

-- may h (a table with model and tenant) take a slot of worker, which holds n of cap? Not at
-- its shared limit while another tenant runs there, nor at its limit while another is active.
local function may_take(h, worker, cap, n)
  if RESERVE <= 0 then return true end
  local shared = math.max(1, math.floor(cap * SHARED_SHARE))
  if n > shared then  -- only then can h hold that many with another tenant here
    local mine = tenant_held(worker, h.tenant)
    if mine >= shared and others_here(worker, h.tenant) then return false end
  end
  local limit = cap - math.max(0, math.min(RESERVE, cap - 1))
  if n < limit or tenant_held(worker, h.tenant) < limit then return true end
  return not others_active(h.model, h.tenant)
end

local function take_slot(iid, model, tenant, worker)
  redis.call('ZADD', K.slots(worker), NOW + TTL, iid)
  redis.call('HSET', K.ticket(iid), 'w', worker)
  redis.call('PEXPIRE', K.ticket(iid), TTL)
  redis.call('SADD', K.workers(), worker)
  rate_tick(model)
  local c = COUNTS[worker]
  if c then c[tenant] = (c[tenant] or 0) + 1 end
end

local GRANTED = {}  -- iid, worker, iid, worker... of this call's grants (scripts may return it)

local function grant(h, worker)
  GRANTED[#GRANTED + 1] = h.iid
  GRANTED[#GRANTED + 1] = worker
  unqueue(h)
  local start = tonumber(string.match(h.key, '^[^:]+:([^:]+):'))
  local f, v = K.fair(h.model), 'v:' .. h.prio
  if start > (tonumber(redis.call('HGET', f, v)) or 0) then redis.call('HSET', f, v, start) end
  take_slot(h.iid, h.model, h.tenant, worker)
  redis.call('PUBLISH', K.wake(h.rep), h.iid .. ' ' .. worker)
end

local function member_ticket(m)
  return ticket(string.match(m, '^[^:]+:[^:]+:[^:]+:(.*)$'))
end

local function dispatch(worker, cap)
  if cap <= 0 then return end
  local n = held(worker)
  local skip = 0  -- waiters passed over: at their tenant's limit
  while n < cap and skip < SCAN do
    local top = redis.call('ZRANGE', K.waiters(worker), skip, skip)
    if #top == 0 then return end
    local h = member_ticket(top[1])
    if not h or h.w or h.key ~= top[1] then
      redis.call('ZREM', K.waiters(worker), top[1])
    elseif not alive(h.rep) then
      drop(h)
    elseif may_take(h, worker, cap, n) then
      grant(h, worker)
      n = n + 1
    else
      skip = skip + 1
    end
  end
end

-- does a live waiter of worker (holding n of cap) exist that may take its next slot?
local function waiter_may_take(worker, cap, n)
  for _, m in ipairs(redis.call('ZRANGE', K.waiters(worker), 0, SCAN - 1)) do
    local h = member_ticket(m)
    if h and not h.w and h.key == m and alive(h.rep) and may_take(h, worker, cap, n) then
      return true
    end
  end
  return false
end

local function dispatch_pairs(first, last)
  for i = first, last, 2 do dispatch(ARGV[i], tonumber(ARGV[i + 1])) end
end

local function status(h)
  if h.w then return {'granted', h.w} end
  local rank = redis.call('ZRANK', K.queue(h.model), h.key)
  return {'queued', (rank or 0) + 1, h.key}
end
"""
)

_ACQUIRE = """
local iid, rep, tid, model, tenant = ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local prio, maxq, maxt = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
heartbeat(rep)
local known = ticket(iid)
if known then return status(known) end
saw(model, tenant)
local function record(...)
  redis.call('HSET', K.ticket(iid), 'model', model, 'tenant', tenant, 'prio', prio, 'rep', rep,
    'tid', tid, 'enq', NOW, ...)
end
local me = {model = model, tenant = tenant}
for i = 14, #ARGV, 2 do
  local w, cap = ARGV[i], tonumber(ARGV[i + 1])
  local n = cap > 0 and held(w) or cap
  if n < cap and may_take(me, w, cap, n) and (redis.call('ZCARD', K.waiters(w)) == 0
      or RESERVE > 0 and not waiter_may_take(w, cap, n)) then
    record()
    take_slot(iid, model, tenant, w)
    return {'granted', w}
  end
end
local depth = redis.call('ZCARD', K.queue(model))
if depth >= maxq then return {'full', depth, tostring(rate_now(model))} end
local f = K.fair(model)
local mine = tonumber(redis.call('HGET', f, 't:' .. tenant)) or 0
if maxt > 0 and mine >= maxt then return {'tenant', mine, tostring(rate_now(model)), depth} end
redis.call('HINCRBY', f, 't:' .. tenant, 1)
local v = tonumber(redis.call('HGET', f, 'v:' .. prio)) or 0
local start = math.max(v, tonumber(redis.call('HGET', f, 'f:' .. prio .. ':' .. tenant)) or v)
redis.call('HSET', f, 'f:' .. prio .. ':' .. tenant, start + 1)
redis.call('HINCRBY', f, 'n:' .. prio .. ':' .. tenant, 1)
local seq = redis.call('INCR', K.seq())
local key = string.format('%010d:%016d:%016d:', prio + LIMIT + 1, start, seq) .. iid
local cands = {}
for i = 14, #ARGV, 2 do
  cands[#cands + 1] = ARGV[i]
  redis.call('ZADD', K.waiters(ARGV[i]), 0, key)
end
record('key', key, 'cands', table.concat(cands, ','))
redis.call('ZADD', K.queue(model), 0, key)
redis.call('SADD', K.replica_tickets(rep), iid)
redis.call('SADD', K.models(), model)
dispatch_pairs(14, #ARGV)
return status(ticket(iid))
""".replace("LIMIT", str(PRIORITY_LIMIT))

_RELEASE = """
redis.call('ZREM', K.slots(ARGV[7]), ARGV[6])
redis.call('DEL', K.ticket(ARGV[6]))
dispatch(ARGV[7], tonumber(ARGV[8]))
return GRANTED
"""

_WITHDRAW = """
local h = ticket(ARGV[6])
if not h then return {'gone'} end
if h.w then return {'granted', h.w} end
local rank = redis.call('ZRANK', K.queue(h.model), h.key)
drop(h)
return {'removed', (rank or 0) + 1, tostring(rate_now(h.model))}
"""

_RECHECK = """
local npairs = tonumber(ARGV[6])
dispatch_pairs(7, 6 + 2 * npairs)
local out = {}
for i = 7 + 2 * npairs, #ARGV do
  local h = ticket(ARGV[i])
  if not h then out[#out + 1] = '?' elseif h.w then out[#out + 1] = h.w else out[#out + 1] = '' end
end
return out
"""

_RENEW = """
local rep, nleases = ARGV[6], tonumber(ARGV[7])
heartbeat(rep)
for i = 8, 7 + 2 * nleases, 2 do
  redis.call('ZADD', K.slots(ARGV[i + 1]), NOW + TTL, ARGV[i])
  redis.call('PEXPIRE', K.ticket(ARGV[i]), TTL)
  redis.call('SADD', K.workers(), ARGV[i + 1])
end
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', K.replicas(), '-inf', '(' .. NOW)) do
  for _, iid in ipairs(redis.call('SMEMBERS', K.replica_tickets(dead))) do
    local h = ticket(iid)
    if h and not h.w then drop(h) end
  end
  redis.call('DEL', K.replica_tickets(dead))
  redis.call('ZREM', K.replicas(), dead)
end
return redis.call('SMEMBERS', K.replica_tickets(rep))
"""

_FORGET = """
for i = 7, #ARGV do
  local h = ticket(ARGV[i])
  if h and not h.w then drop(h) end
  redis.call('SREM', K.replica_tickets(ARGV[6]), ARGV[i])
end
return 1
"""

_RETIRE = """
local rep = ARGV[6]
for _, iid in ipairs(redis.call('SMEMBERS', K.replica_tickets(rep))) do
  local h = ticket(iid)
  if h and not h.w then drop(h) end
end
redis.call('DEL', K.replica_tickets(rep))
redis.call('ZREM', K.replicas(), rep)
return 1
"""

_SNAPSHOT = """
local out = {models = {}, workers = {}, replicas = redis.call('ZRANGEBYSCORE', K.replicas(),
  NOW, '+inf')}
for _, m in ipairs(redis.call('SMEMBERS', K.models())) do
  local members = redis.call('ZRANGE', K.queue(m), 0, -1)
  local oldest = NOW
  for _, key in ipairs(members) do
    local enq = tonumber(redis.call('HGET', K.ticket(string.match(key, '^[^:]+:[^:]+:[^:]+:(.*)$')),
      'enq'))
    if enq and enq < oldest then oldest = enq end
  end
  local tenants, fair = {}, redis.call('HGETALL', K.fair(m))
  for i = 1, #fair, 2 do
    local tenant = string.match(fair[i], '^n:[^:]+:(.*)$')
    if tenant then tenants[tenant] = (tenants[tenant] or 0) + tonumber(fair[i + 1]) end
  end
  out.models[m] = {depth = #members, oldest_wait_s = (NOW - oldest) / 1000, tenants = tenants,
    drain_rate_per_s = rate_now(m)}
end
for _, w in ipairs(redis.call('SMEMBERS', K.workers())) do
  local by = {}
  local leases = redis.call('ZRANGEBYSCORE', K.slots(w), NOW, '+inf')
  for _, iid in ipairs(leases) do
    local rep = string.match(iid, '^(.*)|[^|]*$') or '?'
    by[rep] = (by[rep] or 0) + 1
  end
  out.workers[w] = {held = #leases, by_replica = by}
end
return cjson.encode(out)
"""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What ``acquire`` or ``withdraw`` did.

    ``status``: ``granted`` (``worker``), ``queued`` (``position``, ``key``), ``full``
    (``position`` = depth, ``rate``), ``tenant`` (the tenant's share is full: ``waiting``,
    ``position`` = depth, ``rate``), ``removed`` (``position``, ``rate``) or ``gone``.
    """

    status: str
    worker: str = ""
    position: int = 0
    key: str = ""
    rate: float = 0.0
    waiting: int = 0


def _outcome(reply: list[Any]) -> Outcome:
    status = str(reply[0])
    if status == "granted":
        return Outcome(status, worker=str(reply[1]))
    if status == "queued":
        return Outcome(status, position=int(reply[1]), key=str(reply[2]))
    if status in ("full", "removed"):
        return Outcome(status, position=int(reply[1]), rate=float(reply[2]))
    if status == "tenant":
        return Outcome(status, position=int(reply[3]), rate=float(reply[2]), waiting=int(reply[1]))
    return Outcome(status)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}  # cjson writes an empty table as {} or []


Caps = list[tuple[str, int]]  # (worker, capacity here; 0 when unavailable)


def _flat(pairs: list[tuple[str, Any]]) -> list[Any]:
    return [x for pair in pairs for x in pair]


class Store:
    """Typed calls of the scripts on one Redis client (``decode_responses=True``).

    Every failure surfaces as one of ``connection.py``'s: ``StoreUnavailable`` (unreachable),
    its ``StoreRefused`` (a server-state error reply: full, read-only…) or ``StoreFailed`` (any
    other error reply, a script's error included: this call only). A script the server lost
    (``SCRIPT FLUSH``, a restart) is loaded again by redis-py's ``Script`` on ``NOSCRIPT``.
    """

    def __init__(self, client: Redis, cfg: QueueConfig) -> None:
        self._client = client
        self._common: list[Any] = [
            cfg.redis_prefix,
            int(cfg.lease_ttl_s * 1000),
            int(RATE_TAU_S * 1000),
            cfg.reserved_slots,
            int(cfg.reserve_window_s * 1000),
        ]
        lib = _LIB.replace("RESERVE_SCAN", str(RESERVE_SCAN)).replace(
            "SHARED_SHARE", repr(float(cfg.shared_share))
        )
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(lib + body)
            for name, body in (
                ("acquire", _ACQUIRE),
                ("release", _RELEASE),
                ("withdraw", _WITHDRAW),
                ("recheck", _RECHECK),
                ("renew", _RENEW),
                ("forget", _FORGET),
                ("retire", _RETIRE),
                ("snapshot", _SNAPSHOT),
            )
        }

    async def _run(self, name: str, *args: Any) -> Any:
        try:
            return await self._scripts[name](keys=[], args=[*self._common, *args])
        except REDIS_FAILURES as exc:
            raise store_error(exc) from exc

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except REDIS_FAILURES as exc:
            raise store_error(exc) from exc

    async def acquire(
        self,
        iid: str,
        replica: str,
        ticket: tuple[str, str, str, int],  # (client ticket id, model, tenant, priority)
        caps: Caps,
        max_queued: tuple[int, int],  # (per model, per tenant; 0: no tenant share)
    ) -> Outcome:
        tid, model, tenant, priority = ticket
        args = [iid, replica, tid, model, tenant, clamp_priority(priority), *max_queued]
        return _outcome(await self._run("acquire", *args, *_flat(list(caps))))

    async def release(self, iid: str, worker: str, cap: int) -> list[tuple[str, str]]:
        """Free the slot; returns the ``(iid, worker)`` grants it caused (any replica's)."""
        reply = await self._run("release", iid, worker, cap)
        return [(str(reply[i]), str(reply[i + 1])) for i in range(0, len(reply), 2)]

    async def withdraw(self, iid: str) -> Outcome:
        return _outcome(await self._run("withdraw", iid))

    async def recheck(self, caps: Caps, iids: list[str]) -> list[str]:
        """Dispatch ``caps``; per iid: the granted worker, ``""`` waiting, ``"?"`` gone."""
        reply = await self._run("recheck", len(caps), *_flat(list(caps)), *iids)
        return [str(x) for x in reply]

    async def renew(self, replica: str, leases: list[tuple[str, str]]) -> set[str]:
        """Heartbeat, re-assert ``(iid, worker)`` leases, sweep dead replicas' waiters.

        Returns the iids Redis lists as this replica's waiting tickets.
        """
        reply = await self._run("renew", replica, len(leases), *_flat(list(leases)))
        return {str(x) for x in reply}

    async def forget(self, replica: str, iids: list[str]) -> None:
        """Drop these tickets of ``replica`` if still waiting (their waiters are gone)."""
        if iids:
            await self._run("forget", replica, *iids)

    async def retire(self, replica: str) -> None:
        await self._run("retire", replica)

    async def position(self, model_queue: str, key: str) -> int:
        try:
            rank = await self._client.zrank(model_queue, key)
        except REDIS_FAILURES as exc:
            raise store_error(exc) from exc
        return rank + 1 if isinstance(rank, int) else 1

    async def snapshot(self) -> dict[str, Any]:
        raw = orjson.loads(await self._run("snapshot"))
        models = {m: {**v, "tenants": _dict(v["tenants"])} for m, v in _dict(raw["models"]).items()}
        workers = {
            w: {**v, "by_replica": _dict(v["by_replica"])} for w, v in _dict(raw["workers"]).items()
        }
        replicas = raw["replicas"] if isinstance(raw["replicas"], list) else []
        return {"models": models, "workers": workers, "replicas": replicas}
