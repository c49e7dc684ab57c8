"""While the database cannot be reached the console answers 503 with Retry-After, never a 500
(console.middleware.DatabaseUnavailableMiddleware), wherever the connection is lost: also while django-ninja reads
the view's objects to validate its response (a lazy queryset, a related row), where the database's error reaches
us wrapped in pydantic's ValidationError, its text only. Seen once in CI's restart of PostgreSQL under load
(tests/system/test_database_restart.py: one `GET /api/approvals` answered 500)."""

from __future__ import annotations

import psycopg
import pytest
from django.db import connection
from django.test import Client

from approvals import api
from tests.integration.approvals.test_api_approvals import bearer
from tests.worker import database_url


def cut_this_connection() -> None:
    """Ends the session of this thread's Django connection, as a PostgreSQL restart does, from another one."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])


@pytest.mark.django_db(transaction=True)
def test_a_connection_lost_while_the_response_is_read_is_a_503_not_a_500(demo, monkeypatch):
    headers = bearer(demo["reviewer"])
    listed = api.cards_to_decide

    def cut_before_the_list_is_read(user):
        cards = listed(user)  # lazy: ninja runs its query when it validates the response
        cut_this_connection()
        return cards

    monkeypatch.setattr(api, "cards_to_decide", cut_before_the_list_is_read)
    try:
        response = Client(raise_request_exception=False).get("/api/approvals", headers=headers)
    finally:
        connection.close()  # Django's test client keeps the connection between requests: a server closes it
    assert response.status_code == 503, response.content
    assert response.json()["error"] == "database_unavailable" and response["Retry-After"] == "5"


class NotACard:
    def __getattr__(self, name):
        raise ValueError(f"no {name} here")


class CardsThatCannotBeRead:
    """What the view filters and slices (each step gives itself back) into one object that is not a card."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: self

    def __getitem__(self, key):
        return [NotACard()]


def test_a_response_that_does_not_fit_its_schema_is_still_a_500(demo, monkeypatch):
    """Only a lost connection is an outage: a response that cannot be read for another reason is a bug."""
    monkeypatch.setattr(api, "cards_to_decide", lambda user: CardsThatCannotBeRead())
    response = Client(raise_request_exception=False).get("/api/approvals", headers=bearer(demo["reviewer"]))
    assert response.status_code == 500
