"""Per-key limits in Redis: one budget for every replica, each change one Lua script.

Keys (prefix ``queue.redis_prefix``; ``<name>`` is the key's configured name):

=====================  ======  ====================================================================
key                    type    contents
=====================  ======  ====================================================================
``kl:c:<name>``        zset    running requests (holds): member hold id, score = lease expiry (ms,
                               Redis ``TIME``); renewed every ``lease_ttl_s / 3`` while held, so a
                               dead replica's holds are gone within ``lease_ttl_s``
``kl:h:<name>``        hash    hold id -> tokens it reserved (dropped with the hold)
``kl:r:<name>``        zset    requests of the last minute: member hold id, score = time (ms)
``kl:tl:<name>``       zset    token charges of the last minute: member hold id, score = time
``kl:ta:<name>``       hash    hold id -> its charge (the reservation, then the real usage)
``kl:ts:<name>``       string  the sum of ``kl:ta`` (kept with every change, so a check is O(1)
                               plus the entries that just left the window)
``kl:alive``           string  written by every renewal (expires ``2 * lease_ttl_s`` after): a
                               renewal that succeeds proves Redis takes writes
=====================  ======  ====================================================================

Window keys expire a minute after their last change, hold keys ``2 * lease_ttl_s`` after theirs.
"""

from __future__ import annotations

from typing import Any

from redis.commands.core import AsyncScript

from gpupool.gateway.admission.connection import (
    REDIS_FAILURES,
    Probe,
    redis_client,
    store_error,
)
from gpupool.gateway.security.limits.base import (
    MAX_TOKENS,
    WINDOW_S,
    Limit,
    Policy,
    Refusal,
    Usage,
    tokens_of,
)

# ARGV[1] prefix, ARGV[2] key name, ARGV[3] lease TTL (ms); a body's own arguments follow.
# Token counts go through tok(): whatever a caller passes (1e30, -5, "x", 2.5), an integer in
# [0, MAX_TOKENS] written as digits, so INCRBY/DECRBY never fail half way through a script.
_LIB = """
local P, NAME, TTL = ARGV[1], ARGV[2], tonumber(ARGV[3])
local function tok(v)
  local n = tonumber(v)
  if not n or n ~= n or n <= 0 then return 0 end
  if n > MAX_TOKENS then n = MAX_TOKENS end
  return math.floor(n)
end
local function digits(n) return string.format('%d', n) end
local T = redis.call('TIME')
local NOW = tonumber(T[1]) * 1000 + math.floor(tonumber(T[2]) / 1000)
local WINDOW = WINDOW_MS
local SINCE = NOW - WINDOW
local KC, KH, KR = P .. ':kl:c:' .. NAME, P .. ':kl:h:' .. NAME, P .. ':kl:r:' .. NAME
local KTL, KTA, KTS = P .. ':kl:tl:' .. NAME, P .. ':kl:ta:' .. NAME, P .. ':kl:ts:' .. NAME

local function holds()
  while true do
    local dead = redis.call('ZRANGEBYSCORE', KC, '-inf', '(' .. NOW, 'LIMIT', 0, 500)
    if #dead == 0 then break end
    redis.call('ZREM', KC, unpack(dead))
    redis.call('HDEL', KH, unpack(dead))
  end
  return redis.call('ZCARD', KC)
end

local function requests()
  redis.call('ZREMRANGEBYSCORE', KR, '-inf', SINCE)
  return redis.call('ZCARD', KR)
end

local function tokens()
  while true do
    local old = redis.call('ZRANGEBYSCORE', KTL, '-inf', SINCE, 'LIMIT', 0, 500)
    if #old == 0 then break end
    local freed = 0
    for _, a in ipairs(redis.call('HMGET', KTA, unpack(old))) do
      freed = freed + tok(a)
    end
    redis.call('ZREM', KTL, unpack(old))
    redis.call('HDEL', KTA, unpack(old))
    if freed ~= 0 then redis.call('DECRBY', KTS, digits(freed)) end
  end
  return tonumber(redis.call('GET', KTS)) or 0
end

local function charge(id, n)
  n = tok(n)
  local old = tonumber(redis.call('HGET', KTA, id))
  if not old then redis.call('ZADD', KTL, NOW, id) end
  redis.call('HSET', KTA, id, digits(n))
  redis.call('INCRBY', KTS, digits(n - tok(old)))
  for _, k in ipairs({KTL, KTA, KTS}) do redis.call('PEXPIRE', k, WINDOW + 1000) end
end

local function token_wait(excess)
  local freed = 0
  for start = 0, 4800, 200 do
    local batch = redis.call('ZRANGE', KTL, start, start + 199, 'WITHSCORES')
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      freed = freed + tok(redis.call('HGET', KTA, batch[i]))
      if freed >= excess then return tonumber(batch[i + 1]) + WINDOW - NOW end
    end
  end
  return WINDOW
end
""".replace("WINDOW_MS", str(int(WINDOW_S * 1000))).replace("MAX_TOKENS", str(MAX_TOKENS))

# ARGV[4..8]: rpm, tpm, max_concurrent, hold id, charge. Returns {'ok'} or {limit, wait ms, n}.
_TAKE = """
local rpm, tpm, maxc = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local id, want = ARGV[7], tok(ARGV[8])
if redis.call('ZSCORE', KC, id) then return {'ok'} end
if rpm > 0 and requests() >= rpm then
  local first = redis.call('ZRANGE', KR, 0, 0, 'WITHSCORES')
  return {'rpm', tonumber(first[2]) + WINDOW - NOW, 0}
end
if tpm > 0 then
  local over = tokens() + math.max(want, 1) - tpm
  if over > 0 then return {'tpm', token_wait(over), 0} end
end
local n = holds()
if maxc > 0 and n >= maxc then return {'concurrent', 1000, n} end
redis.call('ZADD', KC, NOW + TTL, id)
redis.call('HSET', KH, id, digits(want))
redis.call('PEXPIRE', KC, 2 * TTL)
redis.call('PEXPIRE', KH, 2 * TTL)
if rpm > 0 then
  redis.call('ZADD', KR, NOW, id)
  redis.call('PEXPIRE', KR, WINDOW + 1000)
end
if tpm > 0 then charge(id, want) end
return {'ok'}
"""

# ARGV[4..7]: tpm, hold id, charge, used (-1: unknown, the charge stands).
_GIVE = """
local tpm, id, want = tonumber(ARGV[4]) or 0, ARGV[5], tok(ARGV[6])
local used = tonumber(ARGV[7]) or -1
if used >= 0 then used = tok(used) end
redis.call('ZREM', KC, id)
redis.call('HDEL', KH, id)
if tpm <= 0 or used < 0 then return 1 end
tokens()
if redis.call('HEXISTS', KTA, id) == 1 then
  charge(id, used)
elseif used > want and redis.call('HEXISTS', KTA, id .. '+') == 0 then
  charge(id .. '+', used - want)  -- the reservation left the window: charge the excess now
end
return 1
"""

# ARGV[4..]: key name, hold id, key name, hold id, ... (ARGV[2] unused). The heartbeat is the
# first write: a full (noeviction) or read-only Redis refuses it while a PING still answers, so
# a renewal that succeeds shows that Redis takes writes again (service.py's recovery).
_RENEW = """
redis.call('SET', P .. ':kl:alive', NOW, 'PX', 2 * TTL)
for i = 4, #ARGV, 2 do
  local kc, kh = P .. ':kl:c:' .. ARGV[i], P .. ':kl:h:' .. ARGV[i]
  redis.call('ZADD', kc, NOW + TTL, ARGV[i + 1])
  redis.call('PEXPIRE', kc, 2 * TTL)
  redis.call('PEXPIRE', kh, 2 * TTL)
end
return 1
"""

_USAGE = """
local reserved = 0
local n = holds()
for _, v in ipairs(redis.call('HVALS', KH)) do reserved = reserved + tok(v) end
return {n, reserved, tokens(), requests()}
"""


class RedisLimits:
    """The ``LimitStore`` shared by every replica through one Redis.

    Request-path calls (``take``, ``give``) use a pool that waits for a free connection;
    ``renew`` and the health probe use a control client of their own (``connection.py``).
    Every failure surfaces as ``StoreUnavailable`` (a server-state error reply as its
    ``StoreRefused``) or, for any other error reply (this call only), ``StoreFailed``; a script
    lost to ``SCRIPT FLUSH`` is loaded again by redis-py's ``Script``.
    """

    def __init__(self, url: str, prefix: str, lease_ttl_s: float) -> None:
        self.lease_ttl_s = lease_ttl_s
        self._client = redis_client(url, lease_ttl_s)
        self._control = redis_client(url, lease_ttl_s, max_connections=2)
        self.probe = Probe(self._control)
        self._prefix = prefix
        self._ttl_ms = int(lease_ttl_s * 1000)
        self._take = self._client.register_script(_LIB + _TAKE)
        self._give = self._client.register_script(_LIB + _GIVE)
        self._usage = self._client.register_script(_LIB + _USAGE)
        self._renew = self._control.register_script(_LIB + _RENEW)

    async def _run(self, script: AsyncScript, name: str, *args: Any) -> Any:
        try:
            return await script(keys=[], args=[self._prefix, name, self._ttl_ms, *args])
        except REDIS_FAILURES as exc:
            raise store_error(exc) from exc

    async def take(self, name: str, policy: Policy, hold_id: str, charge: int) -> Refusal | None:
        p, charge = policy, tokens_of(charge)
        reply = await self._run(self._take, name, p.rpm, p.tpm, p.max_concurrent, hold_id, charge)
        if reply[0] == "ok":
            return None
        return Refusal(Limit(reply[0]), max(0.0, int(reply[1]) / 1000), in_flight=int(reply[2]))

    async def give(
        self, name: str, policy: Policy, hold_id: str, charge: int, used: int | None
    ) -> None:
        used_arg = -1 if used is None else tokens_of(used)
        await self._run(self._give, name, policy.tpm, hold_id, tokens_of(charge), used_arg)

    async def renew(self, holds: list[tuple[str, str]]) -> None:
        """Re-assert these ``(key name, hold id)`` holds for another lease TTL (none: the
        heartbeat alone, a write)."""
        await self._run(self._renew, "", *[x for pair in holds for x in pair])

    async def usage(self, name: str) -> Usage:
        n, reserved, tokens, requests = await self._run(self._usage, name)
        return Usage(int(n), int(reserved), int(tokens), int(requests))

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._control.aclose()
