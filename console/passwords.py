"""Password changes are audited, whoever makes them: an admin in Django admin (console.admin), or users
themselves at /accounts/password_change/. The entry names the user, never the password or its hash."""

from __future__ import annotations

from django.contrib.auth.forms import PasswordChangeForm
from django.contrib.auth.views import PasswordChangeView
from django.db import transaction

from core.models import AuditEntry


def record_password_change(user, *, by) -> None:
    """Inside the transaction that saved `user`'s new password (or made it unusable)."""
    name = user.get_username()
    AuditEntry.record(
        "user.password.change" if user.has_usable_password() else "user.password.disable",
        actor=by,
        target=f"user:{name}",
        data={"user": name},
    )


class AuditedPasswordChangeForm(PasswordChangeForm):
    def save(self, commit=True):
        with transaction.atomic():
            user = super().save(commit)
            if commit:
                record_password_change(user, by=user)
        return user


password_change = PasswordChangeView.as_view(form_class=AuditedPasswordChangeForm)
