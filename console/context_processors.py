"""What every page's template is given: `can`, what the navigation shows the signed-in user (core.access.Navigation)."""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser

from core.access import Navigation


def access(request) -> dict:
    """`can`: what the navigation shows the user (core.access.Navigation: `can.oversee`, `can.audit`, ...), so
    that no template tests a role's name."""
    user = getattr(request, "user", None)
    return {"can": Navigation(user if user is not None else AnonymousUser())}
