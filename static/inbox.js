// The inbox's keyboard shortcuts and bulk selection (templates/approvals/inbox.html). Plain JavaScript.
// j/k move the selection, a approves (POST /approvals/<id>/decide with the card's version; a card with a pending
// edit opens instead, to be approved where the edit is shown), e edits and r rejects
// (both on the card page), o or Enter opens, x ticks the card for a bulk decision, ? shows the keys.
// The rows are re-rendered by htmx every 5 s: the selection and the ticked cards are kept here, by card id,
// and put back after each swap.
(function () {
  "use strict";
  let selected = null; // card id of the selected row
  const ticked = new Set(); // checkbox values ("<id>:<version>") ticked for a bulk decision

  const rows = () => Array.from(document.querySelectorAll("#inbox-rows tr.card-row"));
  const help = () => document.getElementById("inbox-help");

  function csrfToken() {
    try {
      return JSON.parse(document.body.getAttribute("hx-headers") || "{}")["x-csrftoken"] || "";
    } catch (e) {
      return "";
    }
  }

  function flash(text, bad) {
    const el = document.getElementById("inbox-flash");
    if (!el) return;
    el.textContent = text; // text, never HTML
    el.classList.toggle("bad", !!bad);
    el.hidden = false;
    clearTimeout(flash.timer);
    flash.timer = setTimeout(() => { el.hidden = true; }, 4000);
  }

  function select(row, scroll) {
    rows().forEach((r) => { r.classList.remove("selected"); r.removeAttribute("aria-selected"); });
    if (!row) { selected = null; return; }
    row.classList.add("selected");
    row.setAttribute("aria-selected", "true");
    selected = row.dataset.pk;
    if (scroll) row.scrollIntoView({ block: "nearest" });
  }

  function current() {
    return rows().find((r) => r.dataset.pk === selected) || null;
  }

  function move(step) {
    const all = rows();
    if (!all.length) return;
    const at = all.indexOf(current());
    const next = at < 0 ? (step > 0 ? 0 : all.length - 1) : Math.min(all.length - 1, Math.max(0, at + step));
    select(all[next], true);
  }

  async function approve(row) {
    if (!row || row.dataset.busy) return;
    // A pending edit (two-person rule) is what would run: it is approved on the card, where it is shown in full.
    // So is a card whose row cannot show every field that runs (approvals.inbox.row_shows): the server refuses
    // its bulk approval too.
    if (row.dataset.pendingEdit !== undefined || row.dataset.notShown !== undefined) {
      window.location.assign(row.dataset.url);
      return;
    }
    row.dataset.busy = "1";
    row.classList.add("busy");
    const body = new URLSearchParams({ decision: "approve", version: row.dataset.version, comment: "", reason: "" });
    let response;
    try {
      response = await fetch(row.dataset.url + "decide", {
        method: "POST",
        headers: { "X-CSRFToken": csrfToken(), "Content-Type": "application/x-www-form-urlencoded" },
        body: body,
        credentials: "same-origin",
      });
    } catch (e) {
      response = null;
    }
    delete row.dataset.busy;
    row.classList.remove("busy");
    if (response && response.ok) {
      const all = rows();
      const at = all.indexOf(row);
      const after = all[at + 1] || all[at - 1];
      selected = after ? after.dataset.pk : null; // the next card, once this one has left the list
      row.classList.add("decided");
      flash("Card " + row.dataset.pk + " approved.");
    } else if (response && response.status === 409) {
      flash("Card " + row.dataset.pk + " was already decided or changed: the list is refreshed.", true);
    } else {
      flash("Could not approve card " + row.dataset.pk + (response ? " (" + response.status + ")" : "") + ".", true);
    }
    document.body.dispatchEvent(new CustomEvent("approvals-changed", { bubbles: true }));
  }

  // Inline expansion: the card page's own partial (GET /approvals/<id>/ with HX-Request) in the row below.
  function toggleExpand(row) {
    if (!row) return;
    const detail = document.getElementById("detail-" + row.dataset.pk);
    const button = row.querySelector("[data-expand]");
    if (!detail) return;
    const open = detail.hidden;
    detail.hidden = !open;
    if (button) {
      button.setAttribute("aria-expanded", String(open));
      button.textContent = open ? "Collapse" : "Expand";
    }
    if (open && !detail.dataset.loaded) {
      detail.dataset.loaded = "1";
      window.htmx.ajax("GET", row.dataset.url, { target: detail.querySelector("td"), swap: "innerHTML" });
    }
  }

  function toggleHelp() {
    const dialog = help();
    if (!dialog) return;
    if (dialog.open) dialog.close();
    else dialog.showModal();
  }

  // Bulk: one channel at a time. Ticking a card disables the cards of other channels.
  function syncBulk() {
    const boxes = Array.from(document.querySelectorAll('#inbox-rows input[name="cards"]'));
    boxes.forEach((box) => { box.checked = ticked.has(box.value); });
    const pickedChannels = new Set(boxes.filter((b) => b.checked).map((b) => b.dataset.channel));
    // Ticked cards no longer listed (decided elsewhere) are forgotten.
    const listed = new Set(boxes.map((b) => b.value));
    Array.from(ticked).forEach((value) => { if (!listed.has(value)) ticked.delete(value); });
    const channel = pickedChannels.size ? Array.from(pickedChannels)[0] : null;
    boxes.forEach((box) => {
      box.disabled = !!channel && box.dataset.channel !== channel;
      box.title = box.disabled ? "A bulk decision takes cards of one channel (" + channel + ")" : "";
    });
    const count = document.querySelector("[data-bulk-count]");
    if (count) count.textContent = ticked.size ? ticked.size + " selected on " + channel : "No card selected";
    document.querySelectorAll("#bulk button[name=decision]").forEach((b) => { b.disabled = ticked.size === 0; });
    // Approving in bulk takes only cards whose rows show everything that runs (the server refuses the others).
    const notShown = boxes.filter((b) => b.checked && b.dataset.notShown !== undefined).length;
    const approveButton = document.querySelector("#bulk button.approve");
    if (approveButton && notShown) {
      approveButton.disabled = true;
      approveButton.title = notShown + " selected card(s) cannot be approved from the inbox: open them to approve";
    } else if (approveButton) {
      approveButton.title = "";
    }
  }

  function toggleTick(row) {
    const box = row && row.querySelector('input[name="cards"]');
    if (!box || box.disabled) return;
    if (ticked.has(box.value)) ticked.delete(box.value);
    else ticked.add(box.value);
    syncBulk();
  }

  document.addEventListener("change", (event) => {
    const box = event.target;
    if (box.matches && box.matches('#inbox-rows input[name="cards"]')) {
      if (box.checked) ticked.add(box.value);
      else ticked.delete(box.value);
      syncBulk();
    }
  });

  document.addEventListener("click", (event) => {
    const target = event.target;
    if (target.closest && target.closest("[data-inbox-help]")) { toggleHelp(); return; }
    if (target.closest && target.closest("[data-expand]")) {
      const expanding = target.closest("tr.card-row");
      select(expanding, false);
      toggleExpand(expanding);
      return;
    }
    const row = target.closest && target.closest("#inbox-rows tr.card-row");
    if (row && !target.closest("a, input, button")) select(row, false);
  });

  document.addEventListener("keydown", (event) => {
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const target = event.target;
    if (target.closest && target.closest("input, textarea, select, [contenteditable]")) return;
    // Enter and Space keep their own meaning on a focused link, button or summary.
    if ((event.key === "Enter" || event.key === " ") && target.closest && target.closest("a, button, summary")) return;
    const dialog = help();
    if (dialog && dialog.open) {
      if (event.key === "?") { event.preventDefault(); dialog.close(); }
      return; // Esc closes a modal dialog by itself
    }
    const row = current();
    switch (event.key) {
      case "j": move(1); break;
      case "k": move(-1); break;
      case "a": approve(row); break;
      case "e": if (row) window.location.assign(row.dataset.url); break;
      case "r": if (row) window.location.assign(row.dataset.url + "#reject"); break;
      case "o": case "Enter": if (row) window.location.assign(row.dataset.url); else return; break;
      case "x": toggleTick(row); break;
      case " ": toggleExpand(row); break;
      case "?": toggleHelp(); break;
      default: return;
    }
    event.preventDefault();
  });

  // After htmx re-renders the rows: put the selection and the ticks back.
  document.addEventListener("htmx:afterSettle", (event) => {
    const el = event.detail && event.detail.elt;
    if (!el || (el.id !== "inbox-rows" && !document.getElementById("inbox-rows").contains(el))) {
      // A bulk decision went through: the ticks are spent (refused ones are listed in the result).
      if (el && el.id === "bulk-result" && event.detail.xhr && event.detail.xhr.status === 200) ticked.clear();
      syncBulk();
      return;
    }
    const row = current();
    if (row) select(row, false);
    else if (selected !== null) select(null);
    syncBulk();
  });

  // The rows' SLA timers are static/sla.js's, as the card page's.
  document.addEventListener("DOMContentLoaded", syncBulk);
})();
