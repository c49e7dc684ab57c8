from __future__ import annotations

from core.models import Role


def roles(request) -> dict:
    """`user_roles`: the roles (group names) of the logged-in user, for the nav; a superuser is an admin."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"user_roles": set()}
    names = set(user.groups.values_list("name", flat=True))
    if user.is_superuser:
        names.add(Role.ADMIN)
    return {"user_roles": names}
