from __future__ import annotations


def _request_records(caplog):
    return [r.msg for r in caplog.records if r.name == "console.request"]


def test_every_response_has_a_request_id(client, db):
    response = client.get("/healthz")
    assert len(response["X-Request-ID"]) == 32


def test_it_keeps_the_callers_request_id(client, db, caplog):
    response = client.get("/healthz", headers={"X-Request-ID": "abc-123"})
    assert response["X-Request-ID"] == "abc-123"
    (line,) = _request_records(caplog)
    assert line["request_id"] == "abc-123"
    assert (line["method"], line["path"], line["status"]) == ("GET", "/healthz", 200)


def test_it_replaces_a_request_id_that_is_not_one(client, db):
    response = client.get("/healthz", headers={"X-Request-ID": "<script>" + "x" * 100})
    assert response["X-Request-ID"].isalnum()
