"""Who may see and make evaluations: ops and admins (core.access.oversees), as for the dashboard. An evaluation
shows cards of every channel, whoever may decide them, so it is theirs alone; anyone else gets a 404."""

from __future__ import annotations

from core.access import NotVisible, oversees
from evals.models import Evaluation


def check_may_evaluate(user) -> None:
    if not oversees(user):
        raise NotVisible("No such page.")


def evaluation_for(user, pk: int) -> Evaluation:
    check_may_evaluate(user)
    found = Evaluation.objects.filter(pk=pk).select_related("created_by").first()
    if found is None:
        raise NotVisible("No such evaluation.")
    return found
