"""The approvals API on the production server (python -m console.webserver): two reviewers deciding one card at
once make one decision."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from django.contrib.auth.models import User
from django.test import Client

from approvals.models import Decision
from runs.models import Run
from tests.engine_helpers import queued_jobs
from tests.integration.approvals.test_api_approvals import bearer, race, start_parked_run


def test_two_reviewers_deciding_at_once_on_the_real_server_make_one_decision(console_server, rita):
    run, card = start_parked_run(Client(), User.objects.get(username="agent"))
    tokens = [bearer(User.objects.get(username="reviewer")), bearer(rita)]
    body = json.dumps({"decision": "approve", "version": card.version}).encode()

    def post(i: int) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"{console_server.url}/api/approvals/{card.pk}/decision",
            data=body,
            headers={**tokens[i], "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    answers = race(2, post)

    assert sorted(status for status, _ in answers) == [200, 409]
    assert Decision.objects.filter(approval=card).count() == 1
    refused = next(answer for status, answer in answers if status == 409)
    winner = Decision.objects.get().actor.username
    assert f"approved by {winner}" in refused["detail"]
    assert Run.objects.get(pk=run.pk).status == Run.Status.QUEUED
    assert queued_jobs(run) == 1
