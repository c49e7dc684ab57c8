from __future__ import annotations

import csv
import io
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth.models import Group, User
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from console.audit import PAGE_SIZE, AuditFilter
from core.models import AuditEntry, Role

RUN = uuid.UUID("6f1c1d9e-0000-4000-8000-000000000001")
OTHER_RUN = uuid.UUID("6f1c1d9e-0000-4000-8000-000000000002")
T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _entry(**fields) -> AuditEntry:
    """An entry with the given fields, inserted directly: the page reads rows and does not care whether the
    chain is valid (record() would also stamp `at` with the current time)."""
    defaults = {
        "at": T0,
        "actor_type": "human",
        "actor": "bob",
        "action": "approval.approve",
        "prev_hash": AuditEntry.GENESIS,
        "hash": uuid.uuid4().hex * 2,
    }
    return AuditEntry.objects.create(**{**defaults, **fields})


def _rows(response) -> list[int]:
    """The ids of the entries shown, top to bottom."""
    content = response.content.decode()
    return [int(part.split('"', 1)[0]) for part in content.split('data-entry="')[1:]]


@pytest.fixture
def erin(db):
    """In the admin group without being a superuser."""
    user = User.objects.create_user("erin", password="password")
    user.groups.add(Group.objects.get_or_create(name=Role.ADMIN)[0])
    return user


# Who may read it


@pytest.mark.parametrize("url", ["/audit/", "/audit/export.csv"])
@pytest.mark.parametrize(
    ("user", "status"), [("alice", 200), ("erin", 200), ("bob", 403), ("carol", 403), ("dave", 403)]
)
def test_it_is_for_admins_only(client, db, request, url, user, status):
    _entry(data={"comment": "secret business"})
    client.force_login(request.getfixturevalue(user))
    response = client.get(url)
    assert response.status_code == status
    if status == 403:
        assert b"secret business" not in response.content


@pytest.mark.parametrize("url", ["/audit/", "/audit/export.csv"])
def test_anonymous_is_sent_to_login(client, db, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"/accounts/login/?next={url}"


def test_the_nav_links_it_for_admins_only(client, alice, bob):
    client.force_login(alice)
    assert b'href="/audit/"' in client.get("/").content
    client.force_login(bob)
    assert b'href="/audit/"' not in client.get("/").content


# What it shows


def test_it_lists_entries_newest_first(admin_client):
    first = _entry(action="run.cancel", actor="carol", target=f"run:{RUN}", run_id=RUN)
    second = _entry(action="approval.reject", channel="payments", data={"comment": "wrong customer", "reason": "x"})
    response = admin_client.get("/audit/")
    assert response.status_code == 200
    assert _rows(response) == [second.pk, first.pk]
    content = response.content.decode()
    assert "wrong customer" in content and "run.cancel" in content and "payments" in content
    assert second.hash in content and "The audit log is empty" not in content


def test_an_empty_log_says_so(admin_client):
    assert "The audit log is empty" in admin_client.get("/audit/").content.decode()


def test_everything_is_escaped(admin_client):
    _entry(
        actor="<b>mallory</b>",
        target="<img src=x onerror=alert(1)>",
        data={"comment": "<script>alert('comment')</script>", "note": "<script>alert('data')</script>"},
    )
    content = admin_client.get("/audit/").content.decode()
    assert "<script>alert" not in content and "<img src=x" not in content and "<b>mallory" not in content
    assert "&lt;script&gt;alert(&#x27;comment&#x27;)&lt;/script&gt;" in content
    assert "&lt;b&gt;mallory&lt;/b&gt;" in content


def test_runs_and_cards_link_to_their_pages(admin_client):
    _entry(run_id=RUN, approval_id=7)
    content = admin_client.get("/audit/").content.decode()
    assert f'href="/runs/{RUN}/"' in content and 'href="/approvals/7/"' in content


def test_the_action_filter_offers_the_actions_in_the_log(admin_client):
    for action in ["run.cancel", "approval.approve", "run.cancel", "channel.change"]:
        _entry(action=action)
    form = admin_client.get("/audit/").context["form"]
    assert [value for value, _ in form.fields["action"].choices] == [
        "",
        "approval.approve",
        "channel.change",
        "run.cancel",
    ]


# Filters


@pytest.fixture
def varied(db) -> dict[str, AuditEntry]:
    return {
        "bob_approves": _entry(actor="bob", action="approval.approve", channel="payments", run_id=RUN, at=T0),
        "carol_cancels": _entry(
            actor="carol", action="run.cancel", run_id=OTHER_RUN, at=T0 + timedelta(days=1), data={"status": "queued"}
        ),
        "engine_dead": _entry(
            actor="engine", actor_type="system", action="run.dead_letter", run_id=RUN, at=T0 + timedelta(days=2)
        ),
        "bob_rejects": _entry(
            actor="bob",
            action="approval.reject",
            channel="email",
            at=T0 + timedelta(days=3),
            data={"comment": "The customers were refunded twice already"},
        ),
        "alice_changes": _entry(
            actor="alice",
            action="channel.change",
            channel="payments",
            at=T0 + timedelta(days=4),
            data={"comment": "raised the SLA", "changed": {"sla": {"before": "P0DT01H", "after": "P0DT02H"}}},
        ),
    }


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"actor": "bob"}, ["bob_rejects", "bob_approves"]),
        ({"actor_type": "system"}, ["engine_dead"]),
        ({"action": "run.cancel"}, ["carol_cancels"]),
        ({"channel": "payments"}, ["alice_changes", "bob_approves"]),
        ({"run": str(RUN)}, ["engine_dead", "bob_approves"]),
        ({"date_from": "2026-11-02", "date_to": "2026-11-03"}, ["engine_dead", "carol_cancels"]),
        ({"date_from": "2026-11-04"}, ["alice_changes", "bob_rejects"]),
        ({"date_to": "2026-11-01"}, ["bob_approves"]),
        ({"actor": "bob", "channel": "email"}, ["bob_rejects"]),
        ({"actor": "nobody"}, []),
    ],
)
def test_each_filter(admin_client, varied, query, expected):
    response = admin_client.get("/audit/", query)
    assert response.status_code == 200
    assert _rows(response) == [varied[name].pk for name in expected]
    if not expected:
        assert "No entries match these filters" in response.content.decode()


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        ("customer", ["bob_rejects"]),  # stemmed: "customers"
        ("refund", ["bob_rejects"]),  # "refunded"
        ("SLA", ["alice_changes"]),
        ("twice -customers", []),  # web search syntax
        ('"refunded twice"', ["bob_rejects"]),
        ("queued", []),  # only comments are searched, not the rest of the data
        ("the", []),  # a stop word alone matches nothing (and is no error)
    ],
)
def test_full_text_search_on_comments(admin_client, varied, q, expected):
    response = admin_client.get("/audit/", {"q": q})
    assert response.status_code == 200
    assert _rows(response) == [varied[name].pk for name in expected]


def test_full_text_search_is_answered_from_its_index(db, varied):
    form = AuditFilter({"q": "refund"}, actions=[])
    assert form.is_valid()
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # five rows: the planner would rather read the table
        plan = form.entries().order_by().explain()
    assert "console_audit_comment_fts" in plan


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ({"run": "not-a-uuid"}, "Enter a valid UUID"),
        ({"date_from": "2026-11-05", "date_to": "2026-11-01"}, "before its start"),
        ({"date_from": "yesterday"}, "Enter a valid date"),
        ({"action": "no.such.action"}, "Select a valid choice"),
        ({"before": "-3"}, "greater than or equal to 1"),
    ],
)
def test_bad_filters_are_explained_not_a_500(admin_client, varied, query, error):
    response = admin_client.get("/audit/", query)
    assert response.status_code == 200
    assert error in response.content.decode()
    assert _rows(response) == []
    assert admin_client.get("/audit/export.csv", query).status_code == 400


def test_htmx_gets_the_results_partial_and_a_clean_url(admin_client, varied):
    response = admin_client.get(
        "/audit/", {"actor": "bob", "action": "", "channel": "", "q": ""}, headers={"HX-Request": "true"}
    )
    content = response.content.decode()
    assert content.lstrip().startswith('<section id="audit-results"')
    assert "<html" not in content and "<form" not in content
    assert _rows(response) == [varied["bob_rejects"].pk, varied["bob_approves"].pk]
    assert response["HX-Push-Url"] == "/audit/?actor=bob"
    assert "HX-Request" in response["Vary"]
    assert 'href="/audit/export.csv?actor=bob"' in content


def test_a_history_restore_gets_the_whole_page(admin_client, varied):
    response = admin_client.get(
        "/audit/", {"actor": "bob"}, headers={"HX-Request": "true", "HX-History-Restore-Request": "true"}
    )
    assert "<html" in response.content.decode()


def test_the_form_keeps_the_filters_without_javascript(admin_client, varied):
    content = admin_client.get("/audit/", {"actor": "carol", "q": "twice"}).content.decode()
    assert 'name="actor" value="carol"' in content and 'value="twice"' in content


# Keyset pagination


def _page_links(response) -> dict[str, str]:
    context = response.context
    return {name: context[f"{name}_url"] for name in ("older", "newer") if context[f"{name}_url"]}


def test_keyset_pagination_walks_the_whole_log_both_ways(admin_client):
    ids = [_entry(actor="bob" if i % 2 else "carol").pk for i in range(2 * PAGE_SIZE + 10)][::-1]
    first = admin_client.get("/audit/")
    assert _rows(first) == ids[:PAGE_SIZE]
    assert _page_links(first) == {"older": f"/audit/?before={ids[PAGE_SIZE - 1]}"}

    second = admin_client.get(_page_links(first)["older"])
    assert _rows(second) == ids[PAGE_SIZE : 2 * PAGE_SIZE]
    third = admin_client.get(_page_links(second)["older"])
    assert _rows(third) == ids[2 * PAGE_SIZE :]
    assert "older" not in _page_links(third)
    assert "Older" not in third.content.decode()

    back = admin_client.get(_page_links(third)["newer"])
    assert _rows(back) == ids[PAGE_SIZE : 2 * PAGE_SIZE]
    top = admin_client.get(_page_links(back)["newer"])
    assert _rows(top) == ids[:PAGE_SIZE]
    assert _page_links(top) == {"older": f"/audit/?before={ids[PAGE_SIZE - 1]}"}


def test_pages_keep_the_filters(admin_client):
    ids = [_entry(actor="bob" if i % 2 else "carol").pk for i in range(2 * PAGE_SIZE + 10)][::-1]
    bobs = [pk for pk in ids if AuditEntry.objects.get(pk=pk).actor == "bob"]
    first = admin_client.get("/audit/", {"actor": "bob"})
    assert _rows(first) == bobs[:PAGE_SIZE]
    older = _page_links(first)["older"]
    assert older == f"/audit/?actor=bob&before={bobs[PAGE_SIZE - 1]}"
    assert _rows(admin_client.get(older)) == bobs[PAGE_SIZE:]


def test_new_entries_do_not_shift_the_older_pages(admin_client):
    ids = [_entry().pk for _ in range(PAGE_SIZE + 5)][::-1]
    older = _page_links(admin_client.get("/audit/"))["older"]
    _entry()
    assert _rows(admin_client.get(older)) == ids[PAGE_SIZE:]


def _queries(client, url, query=None) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url, query).status_code == 200
    return len(captured)


@pytest.mark.parametrize(
    "query",
    [{}, {"actor": "bob"}, {"q": "refund"}, {"date_from": "2026-01-01", "channel": "payments"}, {"before": "100000"}],
)
def test_a_page_costs_the_same_queries_with_few_or_many_entries(admin_client, query):
    _entry(actor="bob", channel="payments", data={"comment": "refund"})
    few = _queries(admin_client, "/audit/", query)
    AuditEntry.objects.bulk_create(
        AuditEntry(
            at=T0 + timedelta(minutes=i),
            actor_type="human",
            actor=["bob", "carol"][i % 2],
            action=f"action.{i % 7}",
            channel="payments",
            run_id=uuid.uuid4(),
            approval_id=i,
            data={"comment": f"refund number {i}", "reason": "r"},
            prev_hash=AuditEntry.GENESIS,
            hash=uuid.uuid4().hex * 2,
        )
        for i in range(500)
    )
    assert _queries(admin_client, "/audit/", query) == few
    # session, user, the nav's roles, the actions for the filter, the page, the channels for the datalist
    assert few <= 6


# CSV export


def _csv(response) -> list[dict]:
    assert response.streaming
    text = b"".join(response.streaming_content).decode()
    return list(csv.DictReader(io.StringIO(text)))


def test_the_csv_export_has_every_column_of_the_filtered_entries(admin_client, varied):
    response = admin_client.get("/audit/export.csv", {"actor": "bob", "before": "1"})  # cursors do not apply
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"].startswith('attachment; filename="audit-')
    rows = _csv(response)
    rejects, approves = varied["bob_rejects"], varied["bob_approves"]
    assert [int(row["id"]) for row in rows] == [rejects.pk, approves.pk]
    assert list(rows[0]) == [
        "id",
        "at",
        "actor_type",
        "actor",
        "action",
        "target",
        "run_id",
        "approval_id",
        "channel",
        "data",
        "trace_id",
        "prev_hash",
        "hash",
        "hash_scheme",
        "hmac_key_id",
    ]
    assert rows[0]["data"] == '{"comment":"The customers were refunded twice already"}'
    assert (rows[0]["hash"], rows[0]["prev_hash"]) == (rejects.hash, rejects.prev_hash)
    assert (rows[1]["run_id"], rows[1]["at"]) == (str(RUN), "2026-11-01T12:00:00+00:00")


def test_the_csv_export_of_a_real_chain_can_be_checked(admin_client, bob):
    with transaction.atomic():
        entries = [AuditEntry.record("test.action", actor=bob, data={"comment": f"c{i}"}) for i in range(3)]
    rows = _csv(admin_client.get("/audit/export.csv"))[::-1]
    assert [row["hash"] for row in rows] == [entry.hash for entry in entries]
    assert all(later["prev_hash"] == earlier["hash"] for earlier, later in zip(rows, rows[1:], strict=False))


def test_the_csv_export_streams_every_entry_in_chunks(admin_client, settings, monkeypatch):
    monkeypatch.setattr("console.audit.EXPORT_CHUNK", 7)
    ids = [_entry(data={"comment": "refund"}).pk for _ in range(30)][::-1]
    with CaptureQueriesContext(connection) as captured:
        rows = _csv(admin_client.get("/audit/export.csv", {"q": "refund"}))
    assert [int(row["id"]) for row in rows] == ids
    assert sum("LIMIT 7" in query["sql"] for query in captured) == 5  # 30 rows: four chunks of 7, and the last 2


def test_the_csv_export_defuses_spreadsheet_formulas(admin_client):
    _entry(actor="=HYPERLINK(evil)", target="+1", channel="@x", action="-cmd")
    (row,) = _csv(admin_client.get("/audit/export.csv"))
    assert (row["actor"], row["target"], row["channel"], row["action"]) == ("'=HYPERLINK(evil)", "'+1", "'@x", "'-cmd")


def test_the_csv_export_streams_under_asgi_too(async_client, alice, varied):
    async_client.force_login(alice)

    async def fetch() -> bytes:
        response = await async_client.get("/audit/export.csv", {"channel": "payments"})
        assert response.status_code == 200 and response.is_async
        return b"".join([chunk async for chunk in response.streaming_content])

    rows = list(csv.DictReader(io.StringIO(async_to_sync(fetch)().decode())))
    assert [int(row["id"]) for row in rows] == [varied["alice_changes"].pk, varied["bob_approves"].pk]


def test_a_csv_export_is_audited_and_does_not_list_its_own_entry(admin_client, alice, varied):
    before = AuditEntry.objects.count()
    rows = _csv(admin_client.get("/audit/export.csv", {"channel": "payments", "before": "1"}))
    assert [int(row["id"]) for row in rows] == [varied["alice_changes"].pk, varied["bob_approves"].pk]
    export = AuditEntry.objects.get(action="audit.export")
    assert AuditEntry.objects.count() == before + 1
    assert (export.actor, export.actor_type, export.target) == (alice.username, "human", "audit:csv")
    assert export.data == {
        "format": "csv",
        "via": "console",
        "filters": {"channel": "payments"},  # the cursor is not a filter
        "database_head": export.pk - 1,
    }
    assert export.prev_hash == AuditEntry.objects.get(pk=export.pk - 1).hash  # on the chain


@pytest.mark.parametrize(("user", "query", "status"), [("bob", {}, 403), ("alice", {"before": "-3"}, 400)])
def test_a_refused_csv_export_writes_no_entry(client, request, varied, user, query, status):
    before = AuditEntry.objects.count()
    client.force_login(request.getfixturevalue(user))
    assert client.get("/audit/export.csv", query).status_code == status
    assert AuditEntry.objects.count() == before
    assert not AuditEntry.objects.filter(action="audit.export").exists()
