// The SLA timers of the card page and the inbox rows (templates/base.html loads this on every page). Each counts
// down from the seconds the server said were left (data-remaining: the server's clock, not the browser's) and
// changes state by the rule of approvals.rules.sla_state, at the thresholds the server sent: breached at 0, due
// soon under data-soon seconds (the channel's due-soon window). The server renders the same state; this only
// keeps it live, and the rows and cards it re-renders come with fresh figures.
//
// A timer: data-sla="<class prefix>" (its state is also the class <prefix><state>), data-state, data-remaining,
// data-soon; inside it, [data-sla-label] names the state and [data-sla-left] shows the time left, as "clock"
// (1h 02m 03s left, overdue by 4m 05s) or "rough" (1 h 2 min left, breached 4 min ago).
(function () {
  "use strict";

  var LABELS = { on_time: "On time", due_soon: "Due soon", breached: "SLA breached" };

  function pad(n) {
    return (n < 10 ? "0" : "") + n;
  }

  function clock(seconds) {
    var s = Math.abs(Math.trunc(seconds));
    var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    var text = h ? h + "h " + pad(m) + "m " + pad(r) + "s" : m + "m " + pad(r) + "s";
    return seconds <= 0 ? "overdue by " + text : text + " left";
  }

  function rough(seconds) {
    var s = Math.abs(Math.round(seconds));
    var text;
    if (s < 60) text = s + " s";
    else if (s < 3600) text = Math.floor(s / 60) + " min";
    else if (s < 86400) text = Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
    else text = Math.floor(s / 86400) + " d " + Math.floor((s % 86400) / 3600) + " h";
    return seconds > 0 ? text + " left" : "breached " + text + " ago";
  }

  var FORMATS = { clock: clock, rough: rough };

  function state(remaining, soon) {
    return remaining <= 0 ? "breached" : remaining < soon ? "due_soon" : "on_time";
  }

  function tick() {
    var now = Date.now();
    document.querySelectorAll("[data-sla][data-remaining]").forEach(function (el) {
      if (el.dataset.state === "decided") return; // the timer stopped
      if (!el.dataset.seenAt) el.dataset.seenAt = String(now);
      var remaining = Number(el.dataset.remaining) - (now - Number(el.dataset.seenAt)) / 1000;
      var next = state(remaining, Number(el.dataset.soon));
      if (next !== el.dataset.state) {
        el.classList.remove(el.dataset.sla + el.dataset.state);
        el.classList.add(el.dataset.sla + next);
        el.dataset.state = next;
        var label = el.querySelector("[data-sla-label]");
        if (label) label.textContent = LABELS[next];
      }
      el.querySelectorAll("[data-sla-left]").forEach(function (out) {
        out.textContent = (FORMATS[out.dataset.slaLeft] || clock)(remaining);
      });
    });
  }

  tick();
  document.addEventListener("DOMContentLoaded", tick);
  document.addEventListener("htmx:afterSettle", tick);
  setInterval(tick, 1000);
})();
