"""POST /api/webhooks/{source}: a signed delivery starts a run, once (runs.webhooks). No bearer token: the
signature is the authentication."""

from __future__ import annotations

import uuid

from ninja import Router, Schema, Status

from core import tracing
from core.api import ERRORS
from runs import webhooks

router = Router(tags=["webhooks"])


class DeliveryAccepted(Schema):
    id: uuid.UUID
    status: str
    url: str
    delivery: str  # "new" | "duplicate"


@router.post(
    "/webhooks/{source}",
    auth=None,
    response={200: DeliveryAccepted, 202: DeliveryAccepted, **ERRORS},
    summary="Receive a signed webhook delivery (202 with its run; 200 for a delivery id seen before)",
    description="Standard Webhooks headers: `webhook-id` (the delivery id: the same id again is a duplicate), "
    "`webhook-timestamp` (unix seconds, within WEBHOOK_TOLERANCE_SECONDS of the server's clock, 300 by default), "
    "and "
    '`webhook-signature: v1,<base64 HMAC-SHA256 of "<webhook-id>.<webhook-timestamp>.<raw body>">` by one of '
    "the source's secrets (several space-separated signatures are allowed, as during a rotation). "
    "The body is the source's payload (for `demo`: the refund input).",
)
def receive_webhook(request, source: str):
    # The run's root span, continuing the sender's `traceparent` if it sent one (core.tracing).
    route = "/api/webhooks/{source}"
    attributes = {"http.request.method": "POST", "http.route": route, "hitl.webhook.source": source}
    with tracing.server_span(f"POST {route}", request.headers, attributes):
        try:
            delivery, created = webhooks.receive(source, request.headers, request.body)
        except webhooks.Refused as exc:
            return Status(exc.status, {"error": exc.error, "detail": exc.detail})
    run = delivery.run
    return Status(
        202 if created else 200,
        {
            "id": run.id,
            "status": run.status,
            "url": f"/api/runs/{run.id}",
            "delivery": "new" if created else "duplicate",
        },
    )
