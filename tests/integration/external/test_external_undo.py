"""Undo of an external agent's run (issue 27, item 4; external.undo): a successful result declares what undoes it
(`compensation: {action, arguments}`); a cancel and undo of the run, or a later request rejected with "reject and
undo", asks the agent to run those compensations as approval requests like any other (a card each, in reverse
order of the executions); each runs once, and the last one's outcome ends the run compensated, all audited."""

from __future__ import annotations

from datetime import timedelta

import pytest

from approvals import sla
from approvals.models import Approval
from core.models import AuditEntry
from external import executions
from external.models import ActionRequest
from runs import compensations
from runs.errors import UndoRefused
from runs.models import Receipt, Run
from tests.integration.external.test_external_requests import REFUND, Api, ask, decide, digest

VOID = {"action": "void_refund", "arguments": {"order_id": "ord_42"}}


@pytest.fixture
def agent(client, demo):
    return Api(client, demo["agent"])


@pytest.fixture
def reviewer(client, demo):
    return Api(client, demo["reviewer"])


def consumed(agent, reviewer, key: str, run: str | None = None, arguments=None) -> dict:
    """An approved request of the agent's, consumed: its outcome is for the agent to report."""
    arguments = arguments or {**REFUND, "order_id": key}
    fields = {"run": run} if run else {}
    request = ask(agent, key=key, arguments=arguments, schema=None, **fields)[1]
    assert decide(reviewer, request["card_id"], "approve")[0] == 200
    code, go = agent.post(f"/api/approval-requests/{request['id']}/consume", {"arguments_digest": digest(arguments)})
    assert code == 200 and go["go"], go
    return request


def report(agent, request: dict, **body):
    return agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": True, "result": {"id": "r1"}, **body})


def executed(agent, reviewer, key: str, run: str | None = None, compensation=VOID) -> dict:
    request = consumed(agent, reviewer, key, run)
    body = {"compensation": compensation} if compensation else {}
    code, answer = report(agent, request, **body)
    assert code == 200 and answer["execution"]["status"] == "succeeded", answer
    return request


def cancel_and_undo(run_id, user) -> Run:
    return compensations.cancel_and_undo(Run.objects.get(pk=run_id), user)


# --- the result declares its compensation ------------------------------------------------------------------------


def test_a_result_declares_what_undoes_it_and_the_same_report_again_is_the_same(agent, reviewer):
    request = consumed(agent, reviewer, "refund-1")
    assert report(agent, request, compensation=VOID)[0] == 200
    assert ActionRequest.objects.get(pk=request["id"]).compensation == VOID
    # A retry after a lost answer is the same report (the compensation included); another compensation is not.
    code, again = report(agent, request, compensation=VOID)
    assert code == 200 and again["execution"]["status"] == "succeeded"
    code, other = report(agent, request, compensation={**VOID, "arguments": {"order_id": "ord_43"}})
    assert code == 409 and other["error"] == "conflict"
    code, without = report(agent, request)
    assert code == 409
    assert ActionRequest.objects.get(pk=request["id"]).compensation == VOID
    entry = AuditEntry.objects.get(action="external.result", target=f"action_request:{request['id']}")
    assert entry.data["compensation"] == VOID


@pytest.mark.parametrize(
    "body",
    [
        {"compensation": {"action": "drop tables;", "arguments": {}}},
        {"compensation": {"action": "", "arguments": {}}},
        {"compensation": {"action": "x" * 101, "arguments": {}}},
        {"compensation": {"action": "void_refund"}},
        {"compensation": {"action": "void_refund", "arguments": [1, 2]}},
        {"compensation": {"action": "void_refund", "arguments": {"note": "a\x00b"}}},
        {"compensation": "void_refund"},
        {"ok": False, "result": None, "error": "declined by the bank", "compensation": VOID},
    ],
    ids=[
        "bad action",
        "empty action",
        "action too long",
        "no arguments",
        "arguments not an object",
        "NUL",
        "not an object",
        "on a failure",
    ],  # fmt: skip
)
def test_a_bad_compensation_is_refused_and_nothing_is_stored(agent, reviewer, body):
    request = consumed(agent, reviewer, "refund-1")
    if not body.get("ok", True):
        body = {**body}
    code, answer = agent.post(f"/api/approval-requests/{request['id']}/result", {"ok": True, "result": 1, **body})
    assert code in (400, 422) and answer["error"] in ("invalid", "bad_request"), answer
    stored = ActionRequest.objects.select_related("receipt").get(pk=request["id"])
    assert stored.compensation is None and stored.receipt.status == Receipt.Status.PENDING


# --- cancel and undo ---------------------------------------------------------------------------------------------


def test_cancel_and_undo_with_nothing_to_undo_is_refused_and_does_nothing(agent, reviewer, demo):
    # Nothing executed yet: one request waits for a person.
    waiting = ask(agent, key="waiting")[1]
    with pytest.raises(UndoRefused, match="not executed any action"):
        cancel_and_undo(waiting["run_id"], demo["ops"])
    # Executed, with no compensation declared.
    plain = executed(agent, reviewer, "plain", run=waiting["run_id"], compensation=None)
    with pytest.raises(UndoRefused, match="declared a compensation"):
        cancel_and_undo(plain["run_id"], demo["ops"])
    run = Run.objects.get(pk=plain["run_id"])
    assert (run.status, run.cancel_requested, run.undo_reason) == ("external", False, "")
    assert not AuditEntry.objects.filter(action="run.cancel", run_id=run.id).exists()
    assert ActionRequest.objects.filter(run=run).count() == 2
    assert Approval.objects.get(pk=waiting["card_id"]).status == Approval.Status.PENDING


def test_an_execution_whose_outcome_is_unknown_holds_the_undo_back(agent, reviewer, demo):
    done = executed(agent, reviewer, "refund-1")
    consumed(agent, reviewer, "refund-2", run=done["run_id"])
    with pytest.raises(UndoRefused, match="unknown"):
        cancel_and_undo(done["run_id"], demo["ops"])
    assert Run.objects.get(pk=done["run_id"]).status == "external"


def test_cancel_and_undo_asks_the_agent_for_its_compensations_in_reverse_order(agent, reviewer, demo):
    first = executed(agent, reviewer, "refund-1")
    run_id = first["run_id"]
    executed(agent, reviewer, "note", run=run_id, compensation=None)  # nothing to undo there
    second = executed(agent, reviewer, "refund-2", run=run_id, compensation={**VOID, "arguments": {"n": 2}})
    approved = ask(agent, key="approved", arguments={"n": 3}, schema=None, run=run_id)[1]
    assert decide(reviewer, approved["card_id"], "approve")[0] == 200
    waiting = ask(agent, key="waiting", arguments={"n": 4}, schema=None, run=run_id)[1]

    run = cancel_and_undo(run_id, demo["ops"])
    assert run.status == "compensating"
    opened = list(ActionRequest.objects.filter(run_id=run_id, compensates__isnull=False).order_by("undo_order"))
    assert [(r.compensates_id, r.undo_order, r.action, r.arguments) for r in opened] == [
        (second_id := ActionRequest.objects.get(pk=second["id"]).pk, 0, "void_refund", {"n": 2}),
        (ActionRequest.objects.get(pk=first["id"]).pk, 1, "void_refund", {"order_id": "ord_42"}),
    ]
    assert second_id
    # Each is a card in the inbox like any other; the run's pending card closed; the agent sees them as requests.
    inbox = {c["id"]: c for c in reviewer.get("/api/approvals")[1]}
    assert all(r.card_id in inbox and inbox[r.card_id]["proposed"] == r.arguments for r in opened)
    assert Approval.objects.get(pk=waiting["card_id"]).status == Approval.Status.CANCELLED
    code, seen = agent.get(f"/api/approval-requests/{opened[0].pk}")
    assert code == 200 and seen["compensates"] == second["id"] and seen["undo_order"] == 0
    cancel = AuditEntry.objects.get(action="run.cancel", run_id=run_id)
    assert cancel.actor == "ops" and cancel.data["undo"] is True
    # Nothing of the run's way forward runs any more: an approval not yet consumed, or a new request on the run.
    code, refused = agent.post(
        f"/api/approval-requests/{approved['id']}/consume", {"arguments_digest": digest({"n": 3})}
    )
    assert code == 409 and refused["error"] == "run_ended"
    code, refused = ask(agent, key="later", arguments={"n": 5}, schema=None, run=run_id)
    assert code == 409
    # Nor is it undone twice.
    with pytest.raises(UndoRefused):
        cancel_and_undo(run_id, demo["ops"])
    # The registry says what can be undone and what will.
    entries = compensations.registry(Run.objects.get(pk=run_id))
    assert [(e.step, e.compensation is not None, e.extra.get("request_id")) for e in entries] == [
        ("refund_order", True, str(opened[1].pk)),
        ("refund_order", False, None),
        ("refund_order", True, str(opened[0].pk)),
    ]


def test_each_compensation_runs_once_and_the_last_ends_the_run_compensated(agent, reviewer, demo):
    first = executed(agent, reviewer, "refund-1")
    run_id = first["run_id"]
    second = executed(agent, reviewer, "refund-2", run=run_id, compensation={**VOID, "arguments": {"n": 2}})
    cancel_and_undo(run_id, demo["ops"])
    opened = list(ActionRequest.objects.filter(run_id=run_id, compensates__isnull=False).order_by("undo_order"))
    # Nothing to run until a person approves.
    assert agent.get(f"/api/approval-requests?compensations=pending&run={run_id}") == (200, [])
    for request in opened:
        assert decide(reviewer, request.card_id, "approve")[0] == 200
    code, pending = agent.get(f"/api/approval-requests?compensations=pending&run={run_id}")
    assert code == 200 and [p["id"] for p in pending] == [str(r.pk) for r in opened]
    assert [p["compensates"] for p in pending] == [second["id"], first["id"]]

    for number, request in enumerate(opened):
        path = f"/api/approval-requests/{request.pk}"
        body = {"arguments_digest": digest(request.arguments)}
        code, go = agent.post(f"{path}/consume", body)
        assert code == 200 and go["go"] and go["arguments"] == request.arguments
        code, again = agent.post(f"{path}/consume", body)
        assert code == 409 and again["error"] == "already_consumed"
        assert Receipt.objects.get(key=f"undo:external:{request.compensates_id}").status == "pending"
        # A compensation is not undone in its turn.
        code, refused = agent.post(f"{path}/result", {"ok": True, "result": {}, "compensation": VOID})
        assert code == 409 and "not undone in its turn" in refused["detail"]
        assert agent.post(f"{path}/result", {"ok": True, "result": {"voided": number}})[0] == 200
        run = Run.objects.get(pk=run_id)
        assert run.status == ("compensating" if number == 0 else "compensated")

    assert agent.get(f"/api/approval-requests?compensations=pending&run={run_id}") == (200, [])
    run = Run.objects.get(pk=run_id)
    assert run.finished_at is not None and run.result["outcome"] == "compensated"
    assert [e["undo"] for e in run.result["effects"]] == ["done", "done"]
    audited = AuditEntry.objects.filter(run_id=run_id, action="run.compensation").order_by("pk")
    assert [(a.data["effect"], a.data["outcome"], a.data["by"]) for a in audited] == [
        (f"external:{second['id']}", "done", "reviewer"),
        (f"external:{first['id']}", "done", "reviewer"),
    ]
    assert AuditEntry.objects.filter(run_id=run_id, action="run.compensated").count() == 1
    entries = compensations.registry(run)
    assert [(e.outcome, e.undo_answer) for e in entries] == [("done", {"voided": 1}), ("done", {"voided": 0})]


def test_a_declined_compensation_counts_and_a_failed_one_parks_the_run(agent, reviewer, demo):
    first = executed(agent, reviewer, "refund-1")
    run_id = first["run_id"]
    executed(agent, reviewer, "refund-2", run=run_id)
    cancel_and_undo(run_id, demo["ops"])
    latest, earliest = ActionRequest.objects.filter(run_id=run_id, compensates__isnull=False).order_by("undo_order")
    assert decide(reviewer, latest.card_id, "reject", comment="the customer keeps it")[0] == 200
    assert Run.objects.get(pk=run_id).status == "compensating"
    assert decide(reviewer, earliest.card_id, "approve")[0] == 200
    path = f"/api/approval-requests/{earliest.pk}"
    assert agent.post(f"{path}/consume", {"arguments_digest": digest(earliest.arguments)})[0] == 200
    assert agent.post(f"{path}/result", {"ok": False, "error": "the bank said no"})[0] == 200
    run = Run.objects.get(pk=run_id)
    assert run.status == "compensation_failed" and "the bank said no" in run.error
    audited = AuditEntry.objects.filter(run_id=run_id, action="run.compensation").order_by("pk")
    assert [(a.data["outcome"], a.data["by"]) for a in audited] == [("declined", "reviewer"), ("failed", "reviewer")]
    assert AuditEntry.objects.filter(run_id=run_id, action="run.compensation_failed").exists()


def test_a_declined_last_compensation_ends_the_undo(agent, reviewer, demo):
    request = executed(agent, reviewer, "refund-1")
    cancel_and_undo(request["run_id"], demo["ops"])
    (opened,) = ActionRequest.objects.filter(run_id=request["run_id"], compensates__isnull=False)
    assert decide(reviewer, opened.card_id, "reject", comment="keep it")[0] == 200
    run = Run.objects.get(pk=request["run_id"])
    assert run.status == "compensated" and run.result["effects"][0]["undo"] == "declined"


def test_a_compensation_nobody_approves_in_time_is_declined_by_its_expiry(agent, reviewer, demo):
    request = executed(agent, reviewer, "refund-1")
    cancel_and_undo(request["run_id"], demo["ops"])
    (opened,) = ActionRequest.objects.select_related("card").filter(run_id=request["run_id"], compensates__isnull=False)
    assert sla.apply_sla(opened.card_id, opened.card.due_at + timedelta(seconds=1)) == "expire"
    run = Run.objects.get(pk=request["run_id"])
    assert run.status == "compensated" and run.result["effects"][0]["undo"] == "declined"
    (audited,) = AuditEntry.objects.filter(run_id=run.id, action="run.compensation")
    assert (audited.data["outcome"], audited.data["by"]) == ("declined", "expired")


# --- reject and undo ---------------------------------------------------------------------------------------------


def test_a_later_request_rejected_with_undo_undoes_the_run(agent, reviewer, demo):
    request = executed(agent, reviewer, "refund-1")
    later = ask(agent, key="later", arguments={"n": 2}, schema=None, run=request["run_id"])[1]
    card = Approval.objects.get(pk=later["card_id"])
    card.decide(demo["reviewer"], "reject", comment="this went too far", version=card.version, undo=True)
    run = Run.objects.get(pk=request["run_id"])
    assert run.status == "compensating"
    (opened,) = ActionRequest.objects.filter(run=run, compensates__isnull=False)
    assert str(opened.compensates_id) == request["id"] and opened.card.status == Approval.Status.PENDING
    cancel = AuditEntry.objects.get(action="run.cancel", run_id=run.id)
    assert cancel.actor == "reviewer" and cancel.data["undo"] is True


def test_reject_and_undo_with_nothing_to_undo_is_refused_with_the_decision(agent, reviewer, demo):
    request = executed(agent, reviewer, "plain", compensation=None)
    later = ask(agent, key="later", arguments={"n": 2}, schema=None, run=request["run_id"])[1]
    card = Approval.objects.get(pk=later["card_id"])
    with pytest.raises(UndoRefused):
        card.decide(demo["reviewer"], "reject", comment="no", version=card.version, undo=True)
    card.refresh_from_db()
    assert card.status == Approval.Status.PENDING and not card.decisions.exists()
    assert Run.objects.get(pk=request["run_id"]).status == "external"


def test_a_person_who_records_a_compensations_outcome_ends_the_undo(agent, reviewer, demo):
    request = executed(agent, reviewer, "refund-1")
    cancel_and_undo(request["run_id"], demo["ops"])
    (opened,) = ActionRequest.objects.filter(run_id=request["run_id"], compensates__isnull=False)
    assert decide(reviewer, opened.card_id, "approve")[0] == 200
    path = f"/api/approval-requests/{opened.pk}"
    assert agent.post(f"{path}/consume", {"arguments_digest": digest(opened.arguments)})[0] == 200
    assert Run.objects.get(pk=request["run_id"]).status == "compensating"  # the agent never reports
    executions.record_outcome(
        demo["ops"], request["run_id"], opened.step_seq, outcome="succeeded", text="voided in the bank's portal"
    )
    run = Run.objects.get(pk=request["run_id"])
    assert run.status == "compensated" and run.result["effects"][0]["undo"] == "done"
