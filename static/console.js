// Shared by every page (templates/base.html). Lets an element show the error answers it expects in place:
// htmx swaps 2xx answers only, so an element (or the ancestor of the one that sent the request) names the
// statuses whose body is meant to be shown, as data-swap-statuses="409 422". This replaces hx-on attributes,
// which htmx runs through eval and the Content-Security-Policy (console/settings.py) forbids.
document.addEventListener("htmx:beforeSwap", function (event) {
  "use strict";
  var holder = event.target.closest ? event.target.closest("[data-swap-statuses]") : null;
  if (!holder) return;
  var statuses = holder.dataset.swapStatuses.split(/\s+/).map(Number);
  if (statuses.indexOf(event.detail.xhr.status) !== -1) {
    event.detail.shouldSwap = true;
    event.detail.isError = false;
  }
});
