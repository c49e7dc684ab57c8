-- wrk script for POST /api/webhooks/demo (bench/webhook_latency.py runs it): every request is signed afresh
-- (Standard Webhooks), with its own webhook-id and the current webhook-timestamp, as a provider would send it:
--   webhook-signature: v1,<base64 HMAC-SHA256(secret, "<id>.<timestamp>.<raw body>")>
-- The secret is a plain one (its bytes are the key), not a whsec_ one. wrk's LuaJIT has no HMAC, so SHA-256 and
-- base64 are written out here with its `bit` library (checked at load against RFC 4231's test case 2 and
-- RFC 4648's examples).
--
--   wrk -t2 -c16 -d10s --latency -s bench/webhook_wrk.lua http://127.0.0.1:PORT/api/webhooks/demo -- SECRET
-- (`-- SECRET duplicate ID`: delivery id ID for all requests, the deduplicated path)

local bit = require("bit")
local band, bor, bxor, bnot = bit.band, bit.bor, bit.bxor, bit.bnot
local rshift, lshift, ror, tobit = bit.rshift, bit.lshift, bit.ror, bit.tobit

local K = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
}

local function sha256(message)
  local length = #message
  local bits = length * 8
  local tail = { "\128", string.rep("\0", (64 - (length + 9) % 64) % 64) }
  for i = 7, 0, -1 do
    tail[#tail + 1] = string.char(math.floor(bits / 2 ^ (8 * i)) % 256)
  end
  message = message .. table.concat(tail)
  local H = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 }
  local w = {}
  for start = 1, #message, 64 do
    for j = 0, 15 do
      local a, b, c, d = message:byte(start + 4 * j, start + 4 * j + 3)
      w[j] = bor(lshift(a, 24), lshift(b, 16), lshift(c, 8), d)
    end
    for j = 16, 63 do
      local v15, v2 = w[j - 15], w[j - 2]
      local s0 = bxor(ror(v15, 7), ror(v15, 18), rshift(v15, 3))
      local s1 = bxor(ror(v2, 17), ror(v2, 19), rshift(v2, 10))
      w[j] = tobit(w[j - 16] + s0 + w[j - 7] + s1)
    end
    local a, b, c, d, e, f, g, h = H[1], H[2], H[3], H[4], H[5], H[6], H[7], H[8]
    for j = 0, 63 do
      local S1 = bxor(ror(e, 6), ror(e, 11), ror(e, 25))
      local ch = bxor(band(e, f), band(bnot(e), g))
      local t1 = tobit(h + S1 + ch + K[j + 1] + w[j])
      local S0 = bxor(ror(a, 2), ror(a, 13), ror(a, 22))
      local maj = bxor(band(a, b), band(a, c), band(b, c))
      h, g, f, e, d, c, b, a = g, f, e, tobit(d + t1), c, b, a, tobit(t1 + S0 + maj)
    end
    H[1], H[2], H[3], H[4] = tobit(H[1] + a), tobit(H[2] + b), tobit(H[3] + c), tobit(H[4] + d)
    H[5], H[6], H[7], H[8] = tobit(H[5] + e), tobit(H[6] + f), tobit(H[7] + g), tobit(H[8] + h)
  end
  local out = {}
  for i = 1, 8 do
    local v = H[i]
    out[i] = string.char(band(rshift(v, 24), 255), band(rshift(v, 16), 255), band(rshift(v, 8), 255), band(v, 255))
  end
  return table.concat(out)
end

local function xor_with(key, byte)
  return (key:gsub(".", function(c) return string.char(bxor(c:byte(), byte)) end))
end

local function hmac_sha256(key, message)
  if #key > 64 then key = sha256(key) end
  key = key .. string.rep("\0", 64 - #key)
  return sha256(xor_with(key, 0x5c) .. sha256(xor_with(key, 0x36) .. message))
end

local function hex(bytes)
  return (bytes:gsub(".", function(c) return string.format("%02x", c:byte()) end))
end

local ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

local function base64(bytes)
  local out = {}
  for i = 1, #bytes, 3 do
    local a, b, c = bytes:byte(i, i + 2)
    local n = bor(lshift(a, 16), lshift(b or 0, 8), c or 0)
    for j = 0, 3 do
      if j <= #bytes - i + 1 then
        local k = band(rshift(n, 18 - 6 * j), 63) + 1
        out[#out + 1] = ALPHABET:sub(k, k)
      else
        out[#out + 1] = "="
      end
    end
  end
  return table.concat(out)
end

assert(
  hex(hmac_sha256("Jefe", "what do ya want for nothing?"))
    == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
  "SHA-256 self-check failed"
)
assert(base64("f") == "Zg==" and base64("fo") == "Zm8=" and base64("foobar") == "Zm9vYmFy", "base64 self-check failed")

local body = '{"customer_id": "cus_1042", "amount_cents": 900, "currency": "EUR", "reason": "Item arrived damaged"}'
local secret = "demo-secret"
local counter = 0
local prefix = ""

local threads = {}
local next_id = 0
function setup(thread)
  next_id = next_id + 1
  thread:set("id", next_id)
  table.insert(threads, thread)
end

local same_id = nil -- `-- SECRET duplicate ID`: every request of every thread sends one delivery id

local baseline = false -- `-- healthz`: GET /healthz instead, the same server's floor under the same load

function init(args)
  if args[1] == "healthz" then baseline = true end
  if args[1] then secret = args[1] end
  math.randomseed(os.time() + (id or 0))
  prefix = string.format("wrk-%d-%08x-%d", os.time(), math.random(0, 0x7fffffff), id or 0)
  if args[2] == "duplicate" then same_id = assert(args[3], "duplicate needs the delivery id") end
end

function request()
  if baseline then return wrk.format("GET", "/healthz") end
  counter = counter + 1
  local timestamp = tostring(os.time())
  local delivery_id = same_id or (prefix .. "-" .. counter)
  local headers = {
    ["Content-Type"] = "application/json",
    ["webhook-id"] = delivery_id,
    ["webhook-timestamp"] = timestamp,
    ["webhook-signature"] = "v1," .. base64(hmac_sha256(secret, delivery_id .. "." .. timestamp .. "." .. body)),
  }
  return wrk.format("POST", nil, headers, body)
end

statuses = {} -- a global: `done` reads each thread's copy
function response(status, headers, response_body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  -- Each thread counted its own answers; wrk runs `done` in the main thread with the threads' globals.
  local total = {}
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("statuses") or {}) do total[status] = (total[status] or 0) + n end
  end
  for status, n in pairs(total) do io.write(string.format("status %d: %d\n", status, n)) end
  io.write(string.format("latency_us p50=%d p90=%d p99=%d max=%d\n",
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
end
