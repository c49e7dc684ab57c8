"""Who may see and decide a card, for the card page, the inbox and the API alike; built on core.access.

- a card is seen by whoever may approve its channel (`approve_channel`: core.access.may_approve; a superuser holds
  it on every channel); anyone else gets 404, for the card and for a decision on it alike;
- it is decided by them too, except by the person who started its run (separation of duties): they see it, and
  get 403 on a decision. The rule is approvals.rules.decider_refusal, which Approval.decide applies to every
  caller (approvals.sla, deciding with no actor, always may);
- a card opened under an approval policy is decided, at each moment, only by whom its current stage asks (or by
  who covers for a person it names, approvals.models.Delegation): the others who may approve its channel still
  see it (403 on a decision), and their inbox does not list it."""

from __future__ import annotations

from django.contrib.auth.models import User
from django.contrib.postgres.expressions import ArraySubquery
from django.db.models import CharField, Exists, OuterRef, Q, QuerySet
from django.db.models.functions import Cast, Now
from guardian.models import GroupObjectPermission, UserObjectPermission

from approvals.models import Approval, Delegation
from approvals.rules import decider_refusal
from core.access import Forbidden, NotVisible, decidable_channels, may_approve
from core.models import Channel


def may_see_card(user, card: Approval) -> bool:
    """Whoever may approve the card's channel (and decide the card, unless they started its run)."""
    return may_approve(user, card.channel)


def card_for(user, pk: int, *, to_decide: bool = False) -> Approval:
    """The card `pk`: NotVisible when the user may not see it (or it does not exist); Forbidden when they are
    about to decide a card they may not decide (one of a run they started)."""
    card = Approval.objects.select_related("channel", "run", "run__created_by").filter(pk=pk).first()
    if card is None or not may_see_card(user, card):
        raise NotVisible("No such card.")
    if to_decide and (refusal := decider_refusal(user, card, Delegation.covered_by(user))):
        raise Forbidden(refusal)
    return card


def visible_cards(user, channels: list[Channel] | None = None) -> QuerySet[Approval]:
    """The cards `user` may see, open or decided: those of the channels they may approve (`channels`, when the
    caller has loaded them already)."""
    if channels is None:
        return Approval.objects.filter(channel__in=decidable_channels(user))
    return Approval.objects.filter(channel_id__in=[channel.pk for channel in channels])


def cards_to_decide(user, channels: list[Channel] | None = None) -> QuerySet[Approval]:
    """The cards `user` may decide, open or decided: those they see, but those of runs they started, and those
    whose policy's current stage asks others (rules.Asking, as the card's asked_* columns: anyone on the channel,
    the user, a group of theirs, or someone they cover for now)."""
    return visible_cards(user, channels).filter(deciding(user))


def deciding(user) -> Q:
    """Of the cards a user sees, those they may decide (cards_to_decide), over the columns a card shares with its
    inbox count (approvals.models.InboxCount: channel, run_created_by, asked_*), so that both read one rule."""
    # Subqueries, not lists read first: the inbox costs the same number of queries whoever asks.
    groups = ArraySubquery(User.groups.through.objects.filter(user_id=user.pk).values("group_id"))
    # Those the user covers for now who still hold the right to decide this card themselves (the rule of
    # approvals.rules.holds_the_right, in SQL): correlated with each card's channel.
    covering = ArraySubquery(
        Delegation.objects.filter(cover_id=user.pk, until__gt=Now(), user__is_active=True)
        .filter(_may_approve_the_cards_channel())
        .values("user_id")
    )
    asked = (
        Q(asked_anyone=True)
        | Q(asked_users__contains=[user.pk])
        | Q(asked_groups__overlap=groups)
        | Q(asked_users__overlap=covering)
    )
    return ~Q(run_created_by=user) & asked


def _may_approve_the_cards_channel() -> Q:
    """Inside a query of delegations, itself inside a query of cards: the delegation's user holds
    `approve_channel` on the card's channel, as core.access.may_approve reads it (a superuser everywhere; else
    django-guardian's object permission, given to the user or to one of their groups)."""
    channel_pk = Cast(OuterRef(OuterRef("channel_id")), output_field=CharField())
    on_the_channel = Q(
        permission__codename="approve_channel",
        permission__content_type__app_label="core",
        content_type__app_label="core",
        content_type__model="channel",
        object_pk=channel_pk,
    )
    return (
        Q(user__is_superuser=True)
        | Exists(UserObjectPermission.objects.filter(on_the_channel, user_id=OuterRef("user_id")))
        | Exists(GroupObjectPermission.objects.filter(on_the_channel, group__user=OuterRef("user_id")))
    )
