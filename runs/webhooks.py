"""Signed webhooks: `POST /api/webhooks/{source}` (the route is runs.webhook_api) turns a provider's delivery into
a run, once.

A source is registered here with the workflow its deliveries start and a function from the delivery's JSON
object to that workflow's input; its secrets come from settings (WEBHOOK_SECRET_<SOURCE>, each `whsec_<base64>`
or a plain string, comma-separated: more than one is active during a rotation). A request is checked in this
order, each failure answered without a run:

1. the source is registered and has a secret, else 404;
2. the Standard Webhooks signature (core.webhook_signing): `webhook-timestamp` (unix seconds) is within
   WEBHOOK_TOLERANCE_SECONDS of our clock either way, and `webhook-signature` holds a `v1,<base64 HMAC-SHA256
   of "<webhook-id>.<timestamp>.<raw body>">` by one of its secrets, compared in constant time over the raw
   bytes, else 401 (nothing is recorded: the sender is unknown). The id is under the signature, so a captured
   delivery resent under another id is refused here, not taken for a new delivery;
3. `webhook-id` is present and fits the delivery row, else 400;
4. a delivery id already accepted answers 200 with its run, whatever the body;
5. the body is a JSON object (400) that the workflow's input schema accepts (422); a signed delivery refused
   here is recorded as `refused` with the reason, and does not block the same id sent again;
6. the delivery row (unique per source and delivery id) and the run with its job are written in one
   transaction: 202. A copy of the delivery sent at the same moment waits on the unique index for that
   transaction, fails once it commits, and answers 200 with the winner's run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone

from core import safe_input, webhook_signing
from runs import group_commit, submission
from runs.errors import InvalidInput
from runs.models import WebhookDelivery

log = structlog.get_logger("runs.webhooks")

MAX_DELIVERY_ID = WebhookDelivery._meta.get_field("delivery_id").max_length


@dataclass(frozen=True)
class Source:
    """Where deliveries come from and what they start: `to_input(payload)` maps the delivery's JSON object to
    the workflow's input (validated by the workflow's schema), and may raise InvalidInput itself."""

    name: str
    workflow: str
    to_input: Callable[[dict], dict]
    tenant: str = "default"
    run_as: str | None = "agent"  # the service user the runs are created by, when it exists; else none


_SOURCES: dict[str, Source] = {}


def register_source(source: Source) -> Source:
    _SOURCES[source.name] = source
    return source


def secrets_for(name: str) -> list[str]:
    return list(settings.WEBHOOK_SECRETS.get(name, ()))


def served_source(name: str) -> Source | None:
    """The source `name`, when it is registered and has at least one secret."""
    source = _SOURCES.get(name)
    return source if source is not None and secrets_for(name) else None


class Refused(Exception):
    """A delivery answered without a run: `status`, and the `{error, detail}` of the answer."""

    def __init__(self, status: int, error: str, detail: Any):
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail


def verify(source: Source, headers: Mapping[str, str], body: bytes, now: float | None = None) -> None:
    """Raises Refused(401) unless the timestamp is fresh and the signature is one of the source's secrets'."""
    try:
        webhook_signing.verify(
            secrets_for(source.name), headers, body, tolerance=settings.WEBHOOK_TOLERANCE_SECONDS, now=now
        )
    except webhook_signing.BadSignature as exc:
        raise Refused(401, "unauthorized", exc.detail) from None


def receive(name: str, headers: Mapping[str, str], body: bytes) -> tuple[WebhookDelivery, bool]:
    """Checks and ingests one delivery: (delivery, True) when it made its run, (delivery, False) for a delivery
    id already accepted. Raises Refused otherwise."""
    source = served_source(name)
    if source is None:
        raise Refused(404, "not_found", f"No webhook source {name!r}.")
    verify(source, headers, body)
    # The id exactly as signed is the dedup key.
    delivery_id = headers.get("webhook-id", "")
    if not delivery_id.strip():
        raise Refused(400, "bad_request", "The webhook-id header is missing.")
    if len(delivery_id) > MAX_DELIVERY_ID:
        raise Refused(400, "bad_request", f"The webhook-id header is longer than {MAX_DELIVERY_ID} characters.")

    accepted = (
        WebhookDelivery.objects.select_related("run")
        .filter(source=source.name, delivery_id=delivery_id, status=WebhookDelivery.Status.ACCEPTED)
        .first()
    )
    if accepted is not None:
        log.info("webhook duplicate", source=source.name, delivery_id=delivery_id, run_id=str(accepted.run_id))
        return accepted, False

    try:
        payload = safe_input.loads(body)
    except safe_input.UnsafeJson as exc:
        raise _refused(source, delivery_id, Refused(422, "invalid", exc.errors()), str(exc)) from None
    except ValueError:
        raise _refused(source, delivery_id, Refused(400, "bad_request", "The body is not JSON.")) from None
    if not isinstance(payload, dict):
        raise _refused(source, delivery_id, Refused(400, "bad_request", "The body must be a JSON object."))
    try:
        delivery, created = ingest(source, delivery_id, source.to_input(payload))
    except InvalidInput as exc:
        raise _refused(source, delivery_id, Refused(422, "invalid", exc.errors), str(exc)) from None
    event = "webhook accepted" if created else "webhook duplicate"
    log.info(event, source=source.name, delivery_id=delivery_id, run_id=str(delivery.run_id))
    return delivery, created


def ingest(source: Source, delivery_id: str, input: dict) -> tuple[WebhookDelivery, bool]:
    """The delivery row and its run (with the run's first job), in one transaction; for a delivery id already
    accepted, that delivery and False. Raises InvalidInput (nothing written) for an input the workflow refuses."""
    run_as = get_user_model().objects.filter(username=source.run_as).first() if source.run_as else None
    # In one transaction with other deliveries' that come at the same time (runs.group_commit: one commit, one
    # wake-up); the delivery id makes it safe to do again when that transaction's outcome is unknown.
    return group_commit.atomic(lambda: _ingest(source, delivery_id, input, run_as))


def _ingest(source: Source, delivery_id: str, input: dict, run_as) -> tuple[WebhookDelivery, bool]:
    """The body of `ingest`'s transaction (a savepoint of the group's: runs.group_commit.atomic)."""
    try:
        with transaction.atomic():  # a savepoint: the IntegrityError must not abort the transaction
            delivery = WebhookDelivery.objects.create(
                source=source.name, delivery_id=delivery_id, status=WebhookDelivery.Status.ACCEPTED
            )
    except IntegrityError:
        # A transaction that inserted this delivery id first held our INSERT on the unique index until it
        # ended; it failed, so that transaction committed (had it rolled back, our INSERT would have gone
        # in), and under READ COMMITTED this next statement sees its row. The lock orders us after a
        # concurrent retry of a refused delivery, so at most one of them makes a run.
        delivery = (
            WebhookDelivery.objects.select_for_update(of=("self",))
            .select_related("run")
            .get(source=source.name, delivery_id=delivery_id)
        )
        if delivery.status == WebhookDelivery.Status.ACCEPTED:
            return delivery, False
        # Refused earlier (its body, or the schema then): this copy is processed as new, on the same row.
    run, _ = submission.submit(workflow=source.workflow, input=input, tenant=source.tenant, created_by=run_as)
    delivery.status = WebhookDelivery.Status.ACCEPTED
    delivery.run = run
    delivery.error = ""
    delivery.received_at = timezone.now()
    delivery.save(update_fields=["status", "run", "error", "received_at"])
    return delivery, True


def _refused(source: Source, delivery_id: str, refusal: Refused, error: str | None = None) -> Refused:
    """Records a signed delivery refused for its content, and returns the refusal to raise. A row already
    accepted under this id is left alone; one refused before takes the new reason."""
    error = refusal.detail if error is None else error
    log.info("webhook refused", source=source.name, delivery_id=delivery_id, error=error[:300])
    delivery, created = WebhookDelivery.objects.get_or_create(
        source=source.name,
        delivery_id=delivery_id,
        defaults={"status": WebhookDelivery.Status.REFUSED, "error": error},
    )
    if not created:
        WebhookDelivery.objects.filter(pk=delivery.pk, status=WebhookDelivery.Status.REFUSED).update(
            error=error, received_at=timezone.now()
        )
    return refusal
