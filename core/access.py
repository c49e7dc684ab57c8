"""Who may do what (DESIGN "Roles"): the console's one access policy, for the pages, the API and the models alike.
Each app's getters build on it for the objects it owns: a card in approvals/access.py; a run, the circuit breakers
and the dead letters in runs/access.py; a channel and the kill switches here.

Two kinds of right:
- roles, kept as Django groups (core.models.Role: reviewer, ops, admin). `has_role` is the one test of them, with
  the one superuser rule: a superuser holds every role (as Django gives them every permission).
- per channel, django-guardian object permissions: `approve_channel` (see and decide the channel's cards) and
  `operate_channel` (flip its kill switch), `view_pii` (reveal its cards' personal data), which a superuser
  holds on every channel.

A "no" is an `access.Denied`: NotVisible (404: the user may not even see the thing, and learns nothing of it) or
Forbidden (403: they see it and may not do this). The pages answer it with Django's 404 and 403 pages
(console.middleware.AccessDeniedMiddleware), the API with its `{error, detail}` JSON (console.api)."""

from __future__ import annotations

from functools import cached_property

from django.contrib.auth.models import Permission
from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from guardian.shortcuts import get_group_perms, get_objects_for_user, get_user_perms

from core.models import Channel, GlobalKillSwitch, Role


class Denied(Exception):
    """The user may not: NotVisible (404) or Forbidden (403). `status` is the HTTP status it is answered with."""

    status = 404


class NotVisible(Denied):
    """The user may not see the thing (or it does not exist: the two look the same to them)."""

    status = 404


class Forbidden(Denied, PermissionDenied):
    """The user sees the thing and may not do this. Also a PermissionDenied, which Django's admin answers with 403."""

    status = 403


# --- roles ---------------------------------------------------------------------------------------------------


def roles_of(user) -> frozenset[str]:
    """The roles `user` holds: the role groups they are in, every role for a superuser, none for an anonymous or
    deactivated user. Read once per user object (as Django caches permissions): a request reads it once."""
    if not user.is_authenticated or not user.is_active:
        return frozenset()
    if user.is_superuser:
        return frozenset(Role.values)
    if not hasattr(user, "_roles_cache"):
        user._roles_cache = frozenset(user.groups.filter(name__in=Role.values).values_list("name", flat=True))
    return user._roles_cache


def has_role(user, *roles: str) -> bool:
    """Whether `user` holds any of `roles` (a superuser holds every role)."""
    return not roles_of(user).isdisjoint(roles)


def oversees(user) -> bool:
    """Ops and admins see everything that runs: every run, every channel's switch, the circuit breakers, the
    dashboard (read-only where they may not act)."""
    return has_role(user, Role.OPS, Role.ADMIN)


def operates(user) -> bool:
    """Ops act on what runs as a whole: the global kill switch, the circuit breakers, cancelling any run."""
    return has_role(user, Role.OPS)


def may_read_audit(user) -> bool:
    """Admins read the audit log (and export it)."""
    return has_role(user, Role.ADMIN)


# --- channels ------------------------------------------------------------------------------------------------


def may_approve(user, channel: Channel) -> bool:
    """`approve_channel` on `channel`: the user sees and decides its cards (approvals.access)."""
    return user.has_perm("core.approve_channel", channel)


def may_view_pii(user, channel: Channel) -> bool:
    """`view_pii` on `channel`: the user may reveal the clear personal data of its cards (each reveal audited:
    approvals.personal). Held by a superuser on every channel, as the other channel permissions are (Django's
    has_perm); everyone else sees masks."""
    return user.has_perm("core.view_pii", channel)


def decidable_channels(user) -> QuerySet[Channel]:
    """The channels whose cards `user` may see and decide (`approve_channel`)."""
    return get_objects_for_user(user, "core.approve_channel", klass=Channel, accept_global_perms=False)


def may_operate_channel(user, channel: Channel) -> bool:
    """`operate_channel` on `channel`: the user flips its kill switch."""
    return user.has_perm("core.operate_channel", channel)


def may_request(user, channel: Channel) -> bool:
    """`request_channel` on `channel`: the user's token asks for approvals there (an external agent: external)."""
    return user.has_perm("core.request_channel", channel)


def may_act_unreviewed(user, channel: Channel) -> bool:
    """`act_unreviewed` on `channel`: the user's token acts there without a person's approval, once all the same.
    An explicit grant only: to the user or one of their groups, on this channel or on every channel. Never implied
    by superuser (Django's has_perm says yes to a superuser for every permission), since nobody holds it by default."""
    if not user.is_active:
        return False
    codename = "act_unreviewed"
    return (
        codename in get_user_perms(user, channel)
        or codename in get_group_perms(user, channel)
        or Permission.objects.filter(content_type__app_label="core", codename=codename)
        .filter(Q(user=user) | Q(group__user=user))
        .exists()
    )


def operable_channels(user) -> QuerySet[Channel]:
    """The channels whose kill switch `user` may flip (`operate_channel`)."""
    return get_objects_for_user(user, "core.operate_channel", klass=Channel, accept_global_perms=False)


def visible_channels(user) -> QuerySet[Channel]:
    """The channels whose switches `user` sees: every channel for those who oversee, else the channels they
    operate. NotVisible when that is none (reviewers, outsiders: no channels page for them)."""
    if oversees(user):
        return Channel.objects.all()
    channels = operable_channels(user)
    if not channels.exists():
        raise NotVisible("No channel you may operate.")
    return channels


def channel_for(user, name: str, *, to_operate: bool = False) -> Channel:
    """The channel `name`: NotVisible when the user may not see it (or it does not exist); Forbidden when they
    are about to flip its switch without `operate_channel` on it."""
    channel = visible_channels(user).filter(name=name).select_related("kill_switch_by").first()
    if channel is None:
        raise NotVisible("No such channel.")
    if to_operate and not may_operate_channel(user, channel):
        raise Forbidden(f"You may not operate the kill switch of {name}.")
    return channel


def global_switch_for(user, *, to_operate: bool = False) -> GlobalKillSwitch:
    """The global kill switch, seen by whoever sees the channels page; flipped by ops (Forbidden otherwise)."""
    visible_channels(user)
    if to_operate and not operates(user):
        raise Forbidden("Only ops may operate the global kill switch.")
    return GlobalKillSwitch.load()


# --- navigation ----------------------------------------------------------------------------------------------


class Navigation:
    """What the pages' navigation shows the user (`can.oversee`, `can.audit`, ...: console.context_processors),
    read from the rules above when a template asks, so that no template tests a role's name."""

    def __init__(self, user):
        self.user = user

    @cached_property
    def review(self) -> bool:
        return self.user.is_authenticated and decidable_channels(self.user).exists()

    @cached_property
    def oversee(self) -> bool:
        return oversees(self.user)

    @cached_property
    def operate(self) -> bool:
        return operates(self.user)

    @cached_property
    def audit(self) -> bool:
        return may_read_audit(self.user)

    @cached_property
    def admin_site(self) -> bool:
        return self.user.is_authenticated and self.user.is_active and self.user.is_staff
