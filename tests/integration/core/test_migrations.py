"""Every model change has its migration: a missing one would be made on the production database by nobody. And the
move of Channel, GlobalKillSwitch, ApiToken and AuditEntry from the console app down to core (issue 18) keeps, on a
database made before it, every row, every permission granted and the audit chain."""

from __future__ import annotations

import hashlib
import secrets
from io import StringIO

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.core.management.sql import emit_post_migrate_signal
from django.db import DatabaseError, connection, transaction
from django.db.migrations.executor import MigrationExecutor
from guardian.shortcuts import assign_perm

from core.models import ApiToken, AuditEntry, Channel

MOVED = ["apitoken", "auditentry", "channel", "globalkillswitch"]


@pytest.mark.django_db
def test_no_model_change_lacks_a_migration():
    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit:
        pytest.fail(f"a model change has no migration: run `manage.py makemigrations`\n{out.getvalue()}")


# The tests migrate the test database back to before the move and forward again inside the test's transaction,
# which rolls all of it back afterwards (the move changes no schema, only rows and the migration history).


def _migrate_back_before_the_move():
    """The project state before core existed (console.0011, approvals.0008): its historical models."""
    state = MigrationExecutor(connection).migrate([("core", None)])
    ContentType.objects.clear_cache()
    return state.apps


def _migrate_forward_as_manage_py_does() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())
    ContentType.objects.clear_cache()
    # `manage.py migrate` ends with post_migrate: the content types and permissions it finds missing are made.
    emit_post_migrate_signal(verbosity=0, interactive=False, db=connection.alias)


def _content_types() -> list[tuple[str, str]]:
    return sorted(ContentType.objects.filter(model__in=MOVED).values_list("app_label", "model"))


@pytest.fixture(autouse=True)
def _fresh_content_type_cache():
    yield
    ContentType.objects.clear_cache()  # the test's rows are rolled back: ids cached meanwhile mean nothing


def _grant_the_old_way(old, codename: str, channel, *, user=None, group=None) -> None:
    """An object permission as guardian stored it before the move: on the content type (console, channel)."""
    content_type = old.get_model("contenttypes", "ContentType").objects.get(app_label="console", model="channel")
    permission = old.get_model("auth", "Permission").objects.get(content_type=content_type, codename=codename)
    grant = {"permission": permission, "content_type": content_type, "object_pk": str(channel.pk)}
    if user is not None:
        old.get_model("guardian", "UserObjectPermission").objects.create(user_id=user.pk, **grant)
    else:
        old.get_model("guardian", "GroupObjectPermission").objects.create(group_id=group.pk, **grant)


@pytest.mark.django_db
def test_it_keeps_channels_grants_tokens_and_the_audit_chain_through_the_move():
    old = _migrate_back_before_the_move()
    assert _content_types() == [("console", model) for model in MOVED]
    content_type_ids = dict(ContentType.objects.filter(model__in=MOVED).values_list("model", "id"))
    channel = old.get_model("console", "Channel").objects.create(name="payments", required_approvals=2)
    rita = old.get_model("auth", "User").objects.create(username="rita")
    olga = old.get_model("auth", "User").objects.create(username="olga")
    ops = old.get_model("auth", "Group").objects.create(name="night-ops")
    olga.groups.add(ops)
    _grant_the_old_way(old, "approve_channel", channel, user=rita)
    _grant_the_old_way(old, "operate_channel", channel, group=ops)
    # The tables are the same before and after: the rows written now are the old rows.
    with transaction.atomic():
        AuditEntry.record("test.before_the_move", actor="test", channel="payments", data={"n": 1})
    # A token as the code of that time issued it: the model of today has columns (core.0003's callback secret)
    # that the tables of that time lack.
    raw_token = "hitl_" + secrets.token_urlsafe(32)
    old.get_model("console", "ApiToken").objects.create(
        user_id=rita.pk, digest=hashlib.sha256(raw_token.encode()).hexdigest(), prefix=raw_token[5:13]
    )
    with transaction.atomic():
        AuditEntry.record("api_token.create", actor="test", target="user:rita", data={"user": "rita"})
    # Its foreign key is checked at commit, which in this test never comes: PostgreSQL would refuse to ALTER the
    # table (core.0003) with that check pending, as `manage.py migrate` never finds it.
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")

    _migrate_forward_as_manage_py_does()

    assert _content_types() == [("core", model) for model in MOVED]  # renamed, and no duplicate made
    assert dict(ContentType.objects.filter(model__in=MOVED).values_list("model", "id")) == content_type_ids
    assert Permission.objects.filter(codename="approve_channel").count() == 1
    assert Permission.objects.filter(content_type__app_label="console").count() == 0
    channel = Channel.objects.get(pk=channel.pk)
    assert channel.required_approvals == 2
    rita, olga = User.objects.get(username="rita"), User.objects.get(username="olga")
    assert rita.has_perm("core.approve_channel", channel) and not rita.has_perm("core.operate_channel", channel)
    assert olga.has_perm("core.operate_channel", channel) and not olga.has_perm("core.approve_channel", channel)
    assert ApiToken.find(raw_token).user == rita
    assert ApiToken.find(raw_token).callback_secret.startswith("whsec_")  # one of its own, made by core.0003
    assert [e.action for e in AuditEntry.objects.order_by("id")] == ["test.before_the_move", "api_token.create"]
    assert list(AuditEntry.verify_chain()) == []
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEntry.objects.update(actor="mallory")  # the table's triggers came along


@pytest.mark.django_db
def test_it_merges_a_content_type_made_while_the_database_was_migrated_back():
    """Code that already knows core.Channel, run against a database migrated back (`migrate core zero`), makes
    the content type (core, channel) on first use (ContentType.objects.get_for_model) and may grant on it. The
    move then keeps the old content type (its id is in every older grant) and takes the new one's grants over."""
    old = _migrate_back_before_the_move()
    channel = old.get_model("console", "Channel").objects.create(name="payments")
    rita = old.get_model("auth", "User").objects.create(username="rita")
    _grant_the_old_way(old, "approve_channel", channel, user=rita)
    console_channel = ContentType.objects.get(app_label="console", model="channel")
    early = ContentType.objects.get_for_model(Channel)
    assert (early.app_label, early.model) == ("core", "channel")
    approve = Permission.objects.create(content_type=early, codename="approve_channel", name="Can approve")
    sam = User.objects.create(username="sam")
    for user in (User.objects.get(pk=rita.pk), sam):  # rita's second grant is the same grant: one of them stays
        assign_perm(approve, user, Channel.objects.get(pk=channel.pk))

    _migrate_forward_as_manage_py_does()

    assert _content_types() == [("core", model) for model in MOVED]
    assert ContentType.objects.get(app_label="core", model="channel").pk == console_channel.pk
    assert Permission.objects.filter(codename="approve_channel").count() == 1
    channel = Channel.objects.get(pk=channel.pk)
    for name in ("rita", "sam"):
        assert User.objects.get(username=name).has_perm("core.approve_channel", channel)
    assert not User.objects.create(username="dave").has_perm("core.approve_channel", channel)
