"""Who may see and act on runs, the circuit breakers and the dead letters (DESIGN "Roles"), for the pages, the API
and Django admin alike; built on core.access (roles, the one superuser rule, the channel permissions).

- a run is seen by ops and admins (`oversees`), by whoever started it, and by the reviewers of a channel it has a
  card on (`approve_channel`); anyone else gets 404. Ops and its creator cancel it; others who see it get 403.
- the circuit breakers: seen by ops and admins, forced by ops (403 for admins, 404 for anyone else).
- the dead-letter queue: ops and admins see it and requeue; only admins resolve a letter."""

from __future__ import annotations

import uuid

from django.db.models import Exists, OuterRef, Q, QuerySet

from core.access import Forbidden, NotVisible, decidable_channels, has_role, may_approve, operates, oversees
from core.models import Role
from runs import breakers
from runs.models import Run

# --- runs ----------------------------------------------------------------------------------------------------


class _Probe(Exists):
    """EXISTS evaluated row by row: OFFSET 0 keeps PostgreSQL from turning it into a hashed subplan or a join."""

    template = "EXISTS(%(subquery)s OFFSET 0)"


def visible_runs(user) -> QuerySet[Run]:
    """The runs `user` may see: all of them for ops and admins; for others the runs they started and the runs
    with a card on a channel they may approve."""
    if not user.is_authenticated:
        return Run.objects.none()
    if oversees(user):
        return Run.objects.all()
    channels = list(decidable_channels(user).values_list("pk", flat=True))
    # The cards (approvals.models.Approval) through their relation to the run: the runs app does not import the
    # approvals app, which builds on it.
    cards = Run._meta.get_field("approvals").related_model.objects
    # An index probe on each run's cards, newest run first, so a page stops after its rows: not `pk IN (every
    # card of those channels)`, which PostgreSQL hashes before the first row (~150 ms at 100,000 cards; it does
    # the same to a plain EXISTS, hence _Probe).
    with_a_card = _Probe(cards.filter(run=OuterRef("pk"), channel__in=channels))
    return Run.objects.filter(Q(created_by=user) | with_a_card)


def may_see_run(user, run: Run) -> bool:
    """The rule of `visible_runs`, for one run."""
    if not user.is_authenticated:
        return False
    if run.created_by_id == user.pk or oversees(user):
        return True
    return any(may_approve(user, card.channel) for card in run.approvals.select_related("channel"))


def may_operate_run(user, run: Run) -> bool:
    """Cancel it: ops, and whoever started it."""
    return user.is_authenticated and (run.created_by_id == user.pk or operates(user))


def run_for(user, pk: uuid.UUID | str, *, to_operate: bool = False) -> Run:
    """The run `pk`: NotVisible when the user may not see it (an outsider learns nothing about it); Forbidden
    when they are about to cancel a run they may see but not operate."""
    run = Run.objects.select_related("created_by").filter(pk=pk).first()
    if run is None or not may_see_run(user, run):
        raise NotVisible("No such run.")
    if to_operate and not may_operate_run(user, run):
        raise Forbidden("Only ops or the run's creator may cancel it.")
    return run


def may_replay_or_fork(user) -> bool:
    """Replay a run (runs.replay) or fork it (runs.forks): ops and admins, who see every run. A replay re-executes
    the run's code on its record, an operator's diagnosis; a fork acts again on what a run did, on a person's say:
    neither is its creator's (an agent's token) nor a reviewer's."""
    return oversees(user)


def run_for_ops(user, pk: uuid.UUID | str, what: str) -> Run:
    """The run `pk` to replay or fork (`what`): NotVisible when the user may not see it, Forbidden when they may see
    but not replay or fork it."""
    run = run_for(user, pk)
    if not may_replay_or_fork(user):
        raise Forbidden(f"Only ops and admins may {what} a run.")
    return run


# --- circuit breakers ------------------------------------------------------------------------------------------


def may_see_breakers(user) -> bool:
    return oversees(user)


def may_force_breakers(user) -> bool:
    return operates(user)


def check_may_force_breaker(user, system: str) -> None:
    """NotVisible for those who may not see the breakers (or a system without one), Forbidden for those who may
    see them but not force them."""
    if not may_see_breakers(user) or system not in breakers.known_systems():
        raise NotVisible("No such circuit breaker.")
    if not may_force_breakers(user):
        raise Forbidden("Only ops may force a circuit breaker.")


# --- dead letters --------------------------------------------------------------------------------------------


def may_requeue_dead_letters(user) -> bool:
    """Also who sees the dead-letter queue: the people who can act on it."""
    return has_role(user, Role.ADMIN, Role.OPS)


def may_resolve_dead_letters(user) -> bool:
    """A resolved letter is a failure someone decided not to retry: an admin's call."""
    return has_role(user, Role.ADMIN)
