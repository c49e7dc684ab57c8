// The card's SLA timer: counts down from the server's remaining time (not the browser's clock), and turns
// amber when due soon and red when breached. The server renders the same state; this only keeps it live.
(function () {
  "use strict";
  if (window.cardTimers) return; // the script comes with each card partial: one ticker for the whole page
  window.cardTimers = true;

  function format(seconds) {
    var s = Math.abs(Math.trunc(seconds));
    var h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    var text = h ? h + "h " + pad(m) + "m " + pad(r) + "s" : m + "m " + pad(r) + "s";
    return seconds <= 0 ? "overdue by " + text : text + " left";
  }

  var LABELS = { on_time: "On time", due_soon: "Due soon", breached: "SLA breached" };

  function tick() {
    var now = Date.now();
    document.querySelectorAll(".card-sla[data-remaining]").forEach(function (el) {
      if (el.dataset.state === "decided") return;
      if (!el.dataset.seenAt) el.dataset.seenAt = String(now);
      var remaining = Number(el.dataset.remaining) - (now - Number(el.dataset.seenAt)) / 1000;
      var state = remaining <= 0 ? "breached" : remaining < Number(el.dataset.soon) ? "due_soon" : "on_time";
      if (state !== el.dataset.state) {
        el.classList.remove("card-sla-" + el.dataset.state);
        el.classList.add("card-sla-" + state);
        el.dataset.state = state;
        var label = el.querySelector(".card-sla-label");
        if (label) label.textContent = LABELS[state];
      }
      var out = el.querySelector(".card-sla-remaining");
      if (out) out.textContent = format(remaining);
    });
  }

  tick();
  document.addEventListener("DOMContentLoaded", tick);
  document.addEventListener("htmx:afterSettle", tick);
  setInterval(tick, 1000);
})();
