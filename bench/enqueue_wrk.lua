-- wrk script for POST /api/runs (bench/enqueue.py runs it): a refund input with a bearer token, a fresh
-- idempotency key per request, and a summary line of JSON that the bench parses.
--
--   wrk -t2 -c16 -d10s -s bench/enqueue_wrk.lua http://127.0.0.1:PORT/api/runs -- TOKEN [KIND]
--
-- KIND "runs" (default) posts the refund body; "insert" posts an empty body (the bench-only one-INSERT endpoint).

local token = ""
local kind = "runs"
local prefix = ""
local counter = 0

local threads = {}
local next_id = 0
function setup(thread)
  next_id = next_id + 1
  thread:set("id", next_id)
  table.insert(threads, thread)
end

function init(args)
  token = args[1] or ""
  kind = args[2] or "runs"
  math.randomseed(os.time() + (id or 0))
  prefix = string.format("wrk-%d-%08x-%d", os.time(), math.random(0, 0x7fffffff), id or 0)
end

function request()
  counter = counter + 1
  local headers = { ["Content-Type"] = "application/json", ["Authorization"] = "Bearer " .. token }
  local body
  if kind == "runs" then
    body = string.format(
      '{"workflow": "refund", "idempotency_key": "%s-%d", "input": {"customer_id": "cus_%d", '
        .. '"amount_cents": 12500, "currency": "EUR", "reason": "Item arrived damaged"}}',
      prefix, counter, counter)
  else
    body = "{}"
  end
  return wrk.format("POST", nil, headers, body)
end

statuses = {}
function response(status, headers, response_body)
  statuses[status] = (statuses[status] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, thread in ipairs(threads) do
    local counted = thread:get("statuses")
    for status, n in pairs(counted) do total[tostring(status)] = (total[tostring(status)] or 0) + n end
  end
  local parts = {}
  for status, n in pairs(total) do parts[#parts + 1] = string.format('"%s": %d', status, n) end
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "errors_connect": %d, "errors_read": %d, '
      .. '"errors_write": %d, "errors_timeout": %d, "errors_status": %d, '
      .. '"p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, "mean_us": %.1f, "statuses": {%s}}\n',
    summary.requests, summary.duration, summary.errors.connect, summary.errors.read, summary.errors.write,
    summary.errors.timeout, summary.errors.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean,
    table.concat(parts, ", ")))
end
