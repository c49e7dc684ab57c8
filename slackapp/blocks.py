"""A card as a Slack Block Kit message: what the console's card page shows first (the diff's summary, the agent's
rationale, the deadline), Approve and Reject buttons that carry the card's id and the version the person sees,
and "Edit in console", a link to the card. Once the card is closed, the same message with its outcome and who
decided, and no buttons.

Pure: it reads a `CardView` (slackapp.posting makes one from a card), so tests build messages without a database.
Everything the agent wrote is escaped: mrkdwn would otherwise turn `<!channel>` into a mention and `<url|text>`
into a link it chose."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

from approvals.diff import FieldDiff

APPROVE, REJECT, COMMENT_BLOCK, COMMENT_INPUT = "hitl_approve", "hitl_reject", "hitl_comment", "comment"
DECISIONS = {APPROVE: "approve", REJECT: "reject"}  # the action ids our buttons send, and what each decides
MAX_CHANGES = 10  # diff lines shown; the rest are counted ("and 3 more in the console")
MAX_VALUE = 80  # characters of a changed value shown
MAX_TEXT = 2800  # a section's text is at most 3000 characters


@dataclass(frozen=True)
class CardView:
    """What the message shows of a card."""

    id: int
    version: int
    channel: str
    workflow: str
    headline: str
    summary: str  # the agent's rationale
    risk: str
    due_at: datetime
    url: str  # the card in the console, absolute
    status: str
    is_open: bool
    decidable: bool  # an action card that is not shadow: decided here; anything else only in the console
    changes: list[FieldDiff] = field(default_factory=list)  # what approving changes in the current state
    amount: str = ""
    approvals: str = ""  # the two-person count so far ("1 of 2 approvals: bob"), while open
    outcome: str = ""  # once closed: "Approved by bob at 2026-12-02 10:02 UTC"


def escape(text: str) -> str:
    """Text as Slack shows it literally: its three control characters escaped (its documented rule)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _value(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    return escape(_clip(text, MAX_VALUE))


def change_lines(changes: list[FieldDiff]) -> list[str]:
    """The diff's summary: one line per changed field, at most MAX_CHANGES."""
    lines = []
    for change in changes[:MAX_CHANGES]:
        path = escape(change.path)
        if change.op == "added":
            lines.append(f"+ `{path}`: {_value(change.new)}")
        elif change.op == "removed":
            lines.append(f"− `{path}`: {_value(change.old)}")
        else:
            lines.append(f"~ `{path}`: {_value(change.old)} → {_value(change.new)}")
    if len(changes) > MAX_CHANGES:
        lines.append(f"… and {len(changes) - MAX_CHANGES} more in the console")
    return lines


def button_value(view: CardView) -> str:
    """What a button carries back: the card and the version the person saw (a decision on another is refused)."""
    return json.dumps({"card": view.id, "version": view.version}, separators=(",", ":"))


def _section(text: str) -> dict:
    return {"type": "section", "text": {"type": "mrkdwn", "text": _clip(text, MAX_TEXT)}}


def title(view: CardView) -> str:
    """The notification's text (Slack shows it where blocks cannot be shown; mrkdwn, so escaped)."""
    headline = view.headline or view.workflow or "a decision"
    return escape(f"Card {view.id} on {view.channel}: {headline}")


def message(view: CardView) -> dict:
    """The chat.postMessage / chat.update arguments (`text` and `blocks`) for the card as it stands."""
    headline = escape(view.headline or view.workflow or f"card {view.id}")
    facts = [f"*Channel* {escape(view.channel)}", f"*Risk* {escape(view.risk)}"]
    if view.amount:
        facts.append(f"*Amount* {escape(view.amount)}")
    due = f"<!date^{int(view.due_at.timestamp())}^{{date_short_pretty}} {{time}}|{view.due_at:%Y-%m-%d %H:%M} UTC>"
    facts.append(f"*Due* {due}" if view.is_open else f"*Status* {escape(view.status)}")
    blocks: list[dict] = [
        {
            "type": "header",
            "text": {"type": "plain_text", "text": _clip(f"Card {view.id}: {view.headline or view.workflow}", 150)},
        },
        _section(f"*{headline}*\n" + " · ".join(facts)),
        _section("*Rationale*\n" + (escape(view.summary) if view.summary.strip() else "_No rationale given._")),
    ]
    lines = change_lines(view.changes)
    blocks.append(_section("*Changes*\n" + ("\n".join(lines) if lines else "_No change to the current state._")))
    if view.approvals:
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": escape(view.approvals)}]})
    if view.is_open and view.decidable:
        blocks.append(
            {
                "type": "input",
                "block_id": COMMENT_BLOCK,
                "optional": True,
                "label": {"type": "plain_text", "text": "Comment (required to reject)"},
                "element": {"type": "plain_text_input", "action_id": COMMENT_INPUT, "max_length": 3000},
            }
        )
    elements = []
    if view.is_open and view.decidable:
        value = button_value(view)
        elements += [
            {
                "type": "button",
                "action_id": APPROVE,
                "style": "primary",
                "text": {"type": "plain_text", "text": "Approve"},
                "value": value,
            },
            {
                "type": "button",
                "action_id": REJECT,
                "style": "danger",
                "text": {"type": "plain_text", "text": "Reject"},
                "value": value,
            },
        ]
    link = "Edit in console" if view.is_open and view.decidable else "Open in console"
    elements.append(
        {"type": "button", "action_id": "hitl_open", "text": {"type": "plain_text", "text": link}, "url": view.url}
    )
    blocks.append({"type": "actions", "block_id": f"hitl_card_{view.id}", "elements": elements})
    if view.is_open and not view.decidable:
        blocks.append(
            {"type": "context", "elements": [{"type": "mrkdwn", "text": "This card is decided in the console."}]}
        )
    if not view.is_open:
        blocks.append(_section(f"*{escape(view.outcome or view.status.capitalize())}*"))
    return {"text": title(view), "blocks": blocks}
