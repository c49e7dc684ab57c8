"""A card as a Slack Block Kit message: what the console's card page shows first (what approving changes, the
agent's rationale, the deadline), Approve and Reject buttons that carry the card's id and the version the person
sees, and "Edit in console", a link to the card. Once the card is closed, the same message with its outcome and who
decided, and no buttons.

What is shown is what is approved: the message lists every field that approving runs, the changed ones first
(approvals.diff.Shown.to_show: against the card's record of the current state, as the card page shows it), each
with its whole value, one line per field, in sections of at most MAX_TEXT characters, at most MAX_CHANGE_SECTIONS
of them. A field whose line does not fit one section, and the fields past the last section, are left out: the
message says how many, and then offers no Approve button (Reject stays: refusing what one could not read in full
runs nothing), only the link to the console; a click on an Approve button of such a card is refused too
(slackapp.interactions). When the agent's record of the current state holds every value that runs, the message
says so (approvals.diff.CLAIMS_UNCHANGED) and lists every field, never "no change".

Pure: it reads a `CardView` (slackapp.posting makes one from a card), so tests build messages without a database.
Everything the agent wrote is escaped: mrkdwn would otherwise turn `<!channel>` into a mention and `<url|text>`
into a link it chose."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

from approvals.diff import CLAIMS_UNCHANGED, FieldDiff, display

APPROVE, REJECT, COMMENT_BLOCK, COMMENT_INPUT = "hitl_approve", "hitl_reject", "hitl_comment", "comment"
DECISIONS = {APPROVE: "approve", REJECT: "reject"}  # the action ids our buttons send, and what each decides
MAX_TEXT = 2800  # a section's text is at most 3000 characters
# Sections of changed fields: with the message's other blocks (at most 9) well within Slack's 50 blocks, and their
# text (12 x 2,800) within the 40,000 characters Slack keeps of a message.
MAX_CHANGE_SECTIONS = 12


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
    # What approving runs against the current state (approvals.diff.Shown.to_show): every field, changed ones
    # first, that must be shown in full for the card to be approved here.
    changes: list[FieldDiff] = field(default_factory=list)
    claims_unchanged: bool = False  # the agent's current state holds every value that runs (Shown.claims_unchanged)
    amount: str = ""
    approvals: str = ""  # the two-person count so far ("1 of 2 approvals: bob"), while open
    outcome: str = ""  # once closed: "Approved by bob at 2026-12-02 10:02 UTC"


def escape(text: str) -> str:
    """Text as Slack shows it literally: its three control characters escaped (its documented rule)."""
    return str(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _value(value) -> str:
    """A value whole, escaped; text of several lines as a block of its own lines; an empty string said as such."""
    text = display(value)
    if text == "":
        return "_(empty)_"
    text = escape(text)
    return f"\n```\n{text}\n```" if "\n" in text else text


def change_line(change: FieldDiff) -> str:
    path = escape(change.path)
    if change.op == "added":
        return f"+ `{path}`: {_value(change.new)}"
    if change.op == "removed":
        return f"− `{path}`: {_value(change.old)}"
    if change.op == "same":  # the agent says the target has this value already
        return f"= `{path}`: {_value(change.new)}"
    return f"~ `{path}`: {_value(change.old)} → {_value(change.new)}"


def change_sections(changes: list[FieldDiff]) -> tuple[list[str], int]:
    """The changed fields as the texts of sections, each field on its own line(s) with its whole value, and how
    many were left out: a field whose line is longer than a section, and those past MAX_CHANGE_SECTIONS."""
    sections: list[str] = []
    left_out = 0
    for change in changes:
        line = change_line(change)
        if len(line) > MAX_TEXT:
            left_out += 1
        elif sections and len(sections[-1]) + 1 + len(line) <= MAX_TEXT:
            sections[-1] += "\n" + line
        elif len(sections) < MAX_CHANGE_SECTIONS:
            sections.append(line)
        else:
            left_out += 1
    return sections, left_out


def shows_in_full(view: CardView) -> bool:
    """Whether the message shows every field approving runs, whole: the condition of its Approve button."""
    return change_sections(view.changes)[1] == 0


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
    sections, left_out = change_sections(view.changes)
    heading = "*Changes*"
    if view.claims_unchanged:
        heading += f"\n_{escape(CLAIMS_UNCHANGED)}_"
    elif not view.changes:
        heading += "\n_Nothing runs: the proposal is empty._"
    elif any(change.op == "same" for change in view.changes):
        heading += "\n_`=` unchanged, as the card's current state records it (it runs all the same)._"
    if left_out:
        fields = "field" if left_out == 1 else "fields"
        heading += f"\n*{left_out} {fields} not shown here* (too long for Slack): " + (
            "open the card in the console to read everything and approve it."
            if view.is_open and view.decidable
            else "the console shows everything."
        )
    blocks.append(_section(heading))
    blocks += [{"type": "section", "text": {"type": "mrkdwn", "text": text}} for text in sections]
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
        if not left_out:
            elements.append(
                {
                    "type": "button",
                    "action_id": APPROVE,
                    "style": "primary",
                    "text": {"type": "plain_text", "text": "Approve"},
                    "value": value,
                }
            )
        elements += [
            {
                "type": "button",
                "action_id": REJECT,
                "style": "danger",
                "text": {"type": "plain_text", "text": "Reject"},
                "value": value,
            },
        ]
    link = "Edit in console" if view.is_open and view.decidable else "Open in console"
    if view.is_open and view.decidable and left_out:
        link = "Open in console to approve"
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
