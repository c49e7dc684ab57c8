"""`POST /api/slack/interactions`: Slack's interactivity request URL (slackapp.interactions does the work).

Authenticated by Slack's signature, not by a session or a bearer token: exempt from CSRF and from the login
requirement, this view only. Under /api/, so the API's body limit applies (console.body_limit). Slack wants an
answer within three seconds and shows an error for anything but 200: a verified click is answered 200 whatever
became of it (a refusal is told to the clicker through the payload's response_url); a request that is not
Slack's is answered 401 (400 when it is not a payload), as JSON like the rest of the API."""

from __future__ import annotations

from django.contrib.auth.decorators import login_not_required
from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from slackapp import interactions


@csrf_exempt
@login_not_required
@require_POST
def slack_interactions(request):
    body = request.body
    try:
        interactions.verify(request.headers, body)
        click = interactions.click_of(interactions.parse(body), interactions.fingerprint(request.headers))
    except interactions.Refused as exc:
        return JsonResponse({"error": exc.error, "detail": exc.detail}, status=exc.status)
    if click is not None:
        interactions.tell(interactions.act(click))
    return HttpResponse(status=200)
