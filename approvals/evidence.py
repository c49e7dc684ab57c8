"""Per decision, a readable evidence record for an audit export (docs/audit-evidence.md): what was proposed, what
the person was shown, what they decided, when, by whom, and what then executed.

A record has two parts of different strength. `entry` is the decision's audit entry exactly as hashed, and the
summary beside it (core.audit_verifier.decision_summary) is made from that entry alone: both are proven by the
chain, and the bundle's verifier checks them. `database` is read from the database at export time (the card, its
rationale and diff inputs, the decision rows, the receipts of what executed): only as trustworthy as the
database, which is why each record says whether the database still agrees with its entry.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from approvals.models import Approval
from core.audit_verifier import DECISION_ACTIONS, decision_summary
from core.models import AuditEntry
from runs.models import Receipt, ShadowEffect, Step


def records(entries: Iterable[AuditEntry]) -> list[dict]:
    """The evidence record of each decision entry among `entries` (others are skipped), in their order. A few
    queries for the lot, whatever their number: the exporter hands them over a chunk at a time."""
    entries = [entry for entry in entries if entry.action in DECISION_ACTIONS]
    if not entries:
        return []
    cards = {
        card.pk: card
        for card in Approval.objects.filter(pk__in={e.approval_id for e in entries if e.approval_id is not None})
        .select_related("channel", "assigned_group")
        .prefetch_related("decisions__actor", "decisions__on_behalf_of")
    }
    runs = _RunsAtExport({card.run_id for card in cards.values()})
    places = _places_in_their_cards(cards)
    return [_record(entry, cards.get(entry.approval_id), runs, places.get(entry.pk)) for entry in entries]


def _places_in_their_cards(cards: dict[int, Approval]) -> dict[int, int]:
    """Each decision entry of these cards (the period's and all others), by id: its place among its card's
    decision entries. The n-th decision entry of a card was written with its n-th decision row (Approval.decide
    and the SLA's safe default write both in one transaction)."""
    if not cards:
        return {}
    entries = (
        AuditEntry.objects.filter(
            run_id__in={card.run_id for card in cards.values()},  # the indexed column; the card's id narrows it
            approval_id__in=cards,
            action__in=DECISION_ACTIONS,
        )
        .order_by("id")
        .values_list("id", "approval_id")
    )
    counts: dict[int, int] = defaultdict(int)
    places = {}
    for entry_id, card_id in entries:
        places[entry_id] = counts[card_id]
        counts[card_id] += 1
    return places


class _RunsAtExport:
    """The steps, cards and receipts of the decided cards' runs, read once."""

    def __init__(self, run_ids: set):
        self.step_kinds: dict = defaultdict(dict)  # run -> seq -> (name, kind, status)
        for run_id, seq, name, kind, status in Step.objects.filter(run_id__in=run_ids).values_list(
            "run_id", "seq", "name", "kind", "status"
        ):
            self.step_kinds[run_id][seq] = (name, kind, status)
        self.card_steps: dict = defaultdict(set)
        for run_id, seq in Approval.objects.filter(run_id__in=run_ids).values_list("run_id", "step_seq"):
            self.card_steps[run_id].add(seq)
        self.receipts: dict = defaultdict(lambda: defaultdict(list))  # run -> seq -> receipts
        for receipt in Receipt.objects.filter(run_id__in=run_ids).order_by("step_seq", "created_at", "pk"):
            self.receipts[receipt.run_id][receipt.step_seq].append(receipt)
        self.shadow_keys = set(ShadowEffect.objects.filter(run_id__in=run_ids).values_list("key", flat=True))

    def executed_after(self, card: Approval) -> list[dict]:
        """The effects that carried out `card`: the receipts at its step (an agent's tool call, an external
        request, a reconciliation: the step that asked is the step that acts) and, when its step is a workflow
        gate, at the effect steps right after it, up to the next step that is not an effect or has a card of
        its own. By position in the run: no effect records the card that allowed it."""
        steps, receipts = self.step_kinds[card.run_id], self.receipts[card.run_id]
        seqs = [card.step_seq]
        if steps.get(card.step_seq, (None, None, None))[1] == Step.Kind.GATE:
            seq = card.step_seq + 1
            while seq not in self.card_steps[card.run_id]:
                step = steps.get(seq)
                # An effect whose checkpoint is not written yet (its write is pending) shows only by its receipt.
                if (step is None and not receipts.get(seq)) or (step is not None and step[1] != Step.Kind.EFFECT):
                    break
                seqs.append(seq)
                seq += 1
        return [self._receipt(receipt, steps.get(seq)) for seq in seqs for receipt in receipts.get(seq, [])]

    def _receipt(self, receipt: Receipt, step) -> dict:
        name, _, step_status = step if step is not None else (None, None, None)
        return {
            "step_seq": receipt.step_seq,
            "step": name,
            "step_status": step_status,
            "channel": receipt.channel,
            "key": receipt.key,
            # pending: the write may or may not have happened (not done yet, or ambiguous until reconciled).
            "status": receipt.status,
            "shadow": receipt.key in self.shadow_keys,  # recorded, never sent: the reviewer did it by hand
            "external_id": receipt.external_id,
            "response": receipt.response,
            "reconciled": receipt.reconciled,
            "started_at": receipt.created_at,
            "completed_at": receipt.completed_at,
        }


def _record(entry: AuditEntry, card: Approval | None, runs: _RunsAtExport, place: int | None) -> dict:
    line = {"id": entry.pk, "hash": entry.hash, **entry.hashed_fields()}
    summary = decision_summary(line)
    return {**summary, "entry": line, "database": _as_read_from_the_database(summary, card, runs, place)}


def _as_read_from_the_database(summary: dict, card: Approval | None, runs: _RunsAtExport, place: int | None) -> dict:
    if card is None:
        return {
            "card": None,
            "agrees_with_the_entry": False,
            "disagreements": ["the card is not in the database"],
        }
    decisions = sorted(card.decisions.all(), key=lambda d: (d.created_at, d.pk))
    row = decisions[place] if place is not None and place < len(decisions) else None
    earlier = decisions[:place] if row is not None else []
    pending_edit = next((d for d in reversed(earlier) if d.decision == "edit"), None)
    return {
        "card": {
            "id": card.pk,
            "kind": card.kind,
            "channel": card.channel.name,
            "workflow": card.workflow,
            "run_id": str(card.run_id),
            "step_seq": card.step_seq,
            "step": runs.step_kinds[card.run_id].get(card.step_seq, (None,))[0],
            "risk": card.risk,
            "shadow": card.shadow,
            "opened_at": card.created_at,
            "due_at": card.due_at,
            "escalated_to": card.assigned_group.name if card.assigned_group else None,
            # The approval policy the card was opened under, as it kept it: an admin's, or its channel's own rule
            # (`channel_rule: true`, approvals.rules.channel_rule); null on a card opened before cards carried one.
            "policy": card.policy,
            "status": card.status,
            "decided_at": card.decided_at,
        },
        # What the card showed the person: the agent's proposal against the target's state (the diff), its
        # rationale, and the edit waiting for a second person, if one was made before this decision.
        "shown": {
            "proposed": card.proposed,
            "current": card.current,
            "summary": card.summary,
            "rule_id": card.rule_id,
            "confidence": card.confidence,
            "citations": card.citations,
            "pending_edit": _decision_row(pending_edit) if pending_edit is not None else None,
        },
        "decision_row": _decision_row(row) if row is not None else None,
        "executed": runs.executed_after(card),
        **_agreement(summary, card, row),
    }


def _decision_row(decision) -> dict:
    return {
        "by": decision.actor.get_username() if decision.actor else "system",
        "at": decision.created_at,
        "decision": decision.decision,
        "comment": decision.comment,
        "reason": decision.reason,
        "payload": decision.payload,
        "agreement": decision.agreement,
        "done_by_hand": decision.done_by_hand,
        # Under an approval policy: the stage the decision was taken at, and the absent person it was taken for.
        "policy_stage": decision.stage_name or None,
        "on_behalf_of": decision.on_behalf_of.get_username() if decision.on_behalf_of else None,
    }


def _agreement(summary: dict, card: Approval, row) -> dict:
    """Whether what the database says now matches the entry (proven by the chain): a difference means the
    database changed since, or the entry was written differently."""
    disagreements = []
    if summary["run_id"] != str(card.run_id) or summary["channel"] != card.channel.name:
        disagreements.append("the card's run or channel differs from the entry's")
    if summary["proposed"] is not None and summary["proposed"] != card.proposed:
        disagreements.append("the card's proposal differs from the one the entry recorded")
    if row is None:
        disagreements.append("no decision row of the card matches this entry")
    else:
        by = row.actor.get_username() if row.actor else "system"
        if (row.decision, by, row.comment) != (summary["decision"], summary["by"], summary["comment"]):
            disagreements.append("the decision row differs from the entry (decision, person or comment)")
        if row.decision == "edit" and row.payload != summary["approved_to_run"]:
            disagreements.append("the edit's payload differs from the one the entry recorded")
        stage = (summary["policy_stage"] or {}).get("stage") if isinstance(summary["policy_stage"], dict) else None
        behalf = row.on_behalf_of.get_username() if row.on_behalf_of else None
        if (row.stage_name or None, behalf) != (stage, summary["on_behalf_of"]):
            disagreements.append("the decision row's policy stage or 'on behalf of' differs from the entry's")
    return {"agrees_with_the_entry": not disagreements, "disagreements": disagreements}
