"""The session store's writes to Redis, each fenced by the session's lease.

A session's keys (``s:``, ``l:`` and ``o:``, see redis_store.py) share a hash tag, the
session id, so that they are in one hash slot: every script below touches one slot per
call. Every write to them goes through a script that first checks the lease (``o:``):
its value is the owner's **token**, made when it took the session (``PROCESS#N``), and a
write whose token is not the one there is refused, so that after a failover, a partition
or a pause at most one process's writes land, and the one refused learns it has lost the
session (redis_store.py then closes the session here; its client resumes where the lease
is). A lease that is gone (a failover or restart that lost it) is taken again by its
holder only while that holder may be sure nobody else took it meanwhile (``retake``:
it was not paused past its lease; see redis_store.py).

Each script takes many sessions (all of one slot) in one call: a command per session and
flush would cost the gateway more CPU than the frames. Replies: a status per session.

The scripts start with ``#!lua``: Redis 7 then refuses one at once on a read-only replica
(``READONLY``, which a demoted primary answers), instead of running it half way.
"""

from __future__ import annotations

import hashlib
from typing import Any

# Per-session statuses in the scripts' replies (a log append's gap is the log's top + 1).
OK = -1
LOST = -2
RETAKEN = -3  # the renewal found the lease gone and took it again: write the rest again

# The owner check every script begins with, for KEYS[o] and token ARGV[t]: -1 ours, -2 not.
_FENCE = """
local function fence(okey, token, may_take, lease)
  local owner = redis.call('get', okey)
  if owner == token then return -1 end
  if owner == false and may_take then
    redis.call('set', okey, token, 'px', lease)
    return -3
  end
  return -2
end
"""

# The log lane: KEYS per session: its log, its lease. ARGV: key TTL, lease, retake, then per
# session: token, take ("n": a new session's lease, taken if there is none), prev (the
# number the log must hold already; "" for a new log), the first frame's number ("" for
# none: a check alone), the frames joined by newlines (a JSON text has none of its own),
# their token ids a line each ("" for none at all), trim (the first number to keep, or "").
# A log that lacks frames up to prev (a failover lost them) gets nothing: the reply is its
# top + 1 (0: empty or gone) and the owner writes them again from its memory. Frames the
# log has already (a flush sent again after a failure) stay as they are.
APPEND = (
    "#!lua\n"
    + _FENCE
    + """
local ttl, lease, retake = ARGV[1], ARGV[2], ARGV[3] == '1'
local out = {}
local at = 4
for k = 1, #KEYS, 2 do
  local lkey, okey = KEYS[k], KEYS[k + 1]
  local token, take, prev, seq = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  local blob, ids, trim = ARGV[at + 4], ARGV[at + 5], ARGV[at + 6]
  at = at + 7
  local status = fence(okey, token, take == 'n' or retake, lease)
  if status ~= -2 then
    local retaken = status == -3
    status = -1
    local top = -1
    local last = redis.call('xrevrange', lkey, '+', '-', 'COUNT', 1)
    if #last > 0 then top = tonumber(string.match(last[1][1], '^(%d+)')) end
    if prev ~= '' and top < tonumber(prev) then
      status = top + 1
    elseif seq ~= '' then
      local n = tonumber(seq)
      local start, istart = 1, 1
      while true do
        local stop = string.find(blob, "\\n", start, true)
        local frame = string.sub(blob, start, stop and stop - 1 or -1)
        local t = ''
        if ids ~= '' then
          local istop = string.find(ids, "\\n", istart, true)
          t = string.sub(ids, istart, istop and istop - 1 or -1)
          istart = (istop or #ids) + 1
        end
        if n > top then  -- pcall: an id the stream had once (trimmed since) is refused
          if t == '' then
            redis.pcall('xadd', lkey, n .. '-1', 'f', frame)
          else
            redis.pcall('xadd', lkey, n .. '-1', 'f', frame, 't', t)
          end
        end
        n = n + 1
        if not stop then break end
        start = stop + 1
      end
    end
    if status == -1 then
      if trim ~= '' then redis.call('xtrim', lkey, 'MINID', trim .. '-0') end
      redis.call('pexpire', lkey, ttl)
      if retaken then status = -3 end
    end
  end
  out[#out + 1] = status
end
return out
"""
)

# The state lane: KEYS per session: its state, its lease, its log. ARGV: key TTL, lease,
# retake, then per session: token, state ("" for none), take ("n": a new session's lease,
# taken if there is none; "r": this process's again, taken if gone only with retake),
# renew ("1": the lease and the keys' lifetimes renewed; a lease gone is taken again with
# retake), release (ms the keys live on without an owner, or ""), forget ("1": the
# session's keys deleted). A release or a forget is queued only once the log lane has
# written what the session logged before it (redis_store.py): no append lands after it.
SAVE = (
    "#!lua\n"
    + _FENCE
    + """
local ttl, lease, retake = ARGV[1], ARGV[2], ARGV[3] == '1'
local out = {}
local at = 4
for k = 1, #KEYS, 3 do
  local skey, okey, lkey = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local token, state, take = ARGV[at], ARGV[at + 1], ARGV[at + 2]
  local renew, release, forget = ARGV[at + 3], ARGV[at + 4], ARGV[at + 5]
  at = at + 6
  local may_take = take == 'n' or ((take == 'r' or renew == '1') and retake)
  local status = fence(okey, token, may_take, lease)
  if status ~= -2 then
    if forget == '1' then
      redis.call('del', skey, okey, lkey)
    else
      if state ~= '' then redis.call('set', skey, state, 'px', ttl) end
      if release ~= '' then
        redis.call('del', okey)
        redis.call('pexpire', skey, release)
        redis.call('pexpire', lkey, release)
      elseif renew == '1' then
        redis.call('pexpire', okey, lease)
        redis.call('pexpire', skey, ttl)
        redis.call('pexpire', lkey, ttl)
      end
    end
  end
  out[#out + 1] = status
end
return out
"""
)


def sha(script: str) -> str:
    """What ``SCRIPT LOAD`` answers for ``script`` (its SHA-1), for EVALSHA."""
    return hashlib.sha1(script.encode()).hexdigest()


def load_commands() -> list[tuple[Any, ...]]:
    """Each script loaded on a node, before a lane's first EVALSHA on a connection to it
    (a failover's new primary, a restarted node: each connection loads them again)."""
    return [("SCRIPT", "LOAD", APPEND), ("SCRIPT", "LOAD", SAVE)]


APPEND_SHA = sha(APPEND)
SAVE_SHA = sha(SAVE)


def statuses(reply: Any) -> list[int]:
    """A script's reply: a status per session, in the order the sessions were given."""
    return [int(x) for x in reply]
