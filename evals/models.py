"""An evaluation: a candidate (an approval rule now; a workflow version later) run offline over the cards of a
period, saved with its figures so that two candidates can be compared (docs/evaluate.md)."""

from __future__ import annotations

import json
from datetime import datetime

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction

from core.models import AuditEntry
from evals import records, versions
from evals.rules import Candidate


class Evaluation(models.Model):
    class Kind(models.TextChoices):
        RULE = "rule", "approval rule"
        VERSION = "version", "workflow version"

    kind = models.CharField(max_length=16, choices=Kind.choices, default=Kind.RULE)
    name = models.CharField(max_length=200, blank=True)
    # As given (evals.rules reads it): what was evaluated, kept whole so that it can be read again or re-run.
    candidate = models.JSONField(encoder=DjangoJSONEncoder)
    period_start = models.DateTimeField()
    period_end = models.DateTimeField()
    figures = models.JSONField(encoder=DjangoJSONEncoder)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(kind__in=["rule", "version"]), name="evals_evaluation_kind_valid"
            ),
            models.CheckConstraint(
                condition=models.Q(period_end__gt=models.F("period_start")), name="evals_evaluation_period_ordered"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} evaluation {self.name or self.pk}"

    @classmethod
    def of_rule(
        cls, raw_candidate, since: datetime, until: datetime, *, name: str = "", by=None, save: bool = True
    ) -> Evaluation:
        """Evaluate an approval rule (evals.rules) over the cards closed in [since, until); saved and audited
        (`evaluation.create`) unless `save` is false. Raises CandidateInvalid or EmptyPeriod, saving nothing."""
        candidate = Candidate.parse(raw_candidate)
        if not isinstance(raw_candidate, dict):
            raw_candidate = json.loads(raw_candidate)  # it parsed above
        figures = records.evaluate(candidate, since, until)
        evaluation = cls(
            kind=cls.Kind.RULE,
            name=(name or candidate.name or "unnamed rule")[:200],
            candidate=raw_candidate,
            period_start=since,
            period_end=until,
            figures=figures,
            created_by=by,
        )
        if save:
            evaluation.save_audited()
        return evaluation

    @classmethod
    def of_version(cls, raw_candidate, since: datetime, until: datetime, *, name: str = "", by=None) -> Evaluation:
        """Evaluate a workflow or prompt version (evals.versions) over the runs created in [since, until), not saved
        (save_audited). Raises CandidateInvalid or EmptyPeriod."""
        candidate = versions.read(raw_candidate)
        figures = versions.evaluate(candidate, since, until)
        default = f"{candidate['workflow']} v{candidate['version']}, model {candidate['model']}"
        return cls(
            kind=cls.Kind.VERSION,
            name=(name or candidate["name"] or default)[:200],
            candidate={k: v for k, v in candidate.items() if k != "name" or v},
            period_start=since,
            period_end=until,
            figures=figures,
            created_by=by,
        )

    def save_audited(self) -> None:
        """Save it with its audit entry, in one transaction."""
        with transaction.atomic():
            self.save()
            AuditEntry.record(
                "evaluation.create",
                actor=self.created_by,
                target=f"evaluation:{self.pk}",
                data={
                    "kind": self.kind,
                    "name": self.name,
                    "candidate": self.candidate,
                    "period": [self.period_start.isoformat(), self.period_end.isoformat()],
                    "headline": self.headline,
                },
            )

    def as_dict(self) -> dict:
        """The evaluation as the API and `manage.py evaluate --json` give it."""
        return {
            "id": self.pk,
            "kind": self.kind,
            "name": self.name,
            "period_start": self.period_start,
            "period_end": self.period_end,
            "created_by": self.created_by.get_username() if self.created_by else None,
            "created_at": self.created_at,
            "headline": self.headline,
            "candidate": self.candidate,
            "figures": self.figures,
        }

    @property
    def headline(self) -> dict:
        """The figures a list shows and two evaluations are compared on."""
        f = self.figures
        if self.kind == self.Kind.VERSION:
            return {
                "runs": f.get("runs"),
                "identical": f.get("identical"),
                "diverged": f.get("diverged"),
                "changed_proposals": f.get("changed_proposals"),
                "cost_delta": (f.get("delta") or {}).get("cost"),
            }
        return {
            "decided_by_person": f.get("decided_by_person"),
            "candidate_decided": f.get("candidate_decided"),
            "agreement": f.get("agreement"),
            "dangerous": f.get("dangerous", {}).get("count"),
            "refused_approved": f.get("refused_approved", {}).get("count"),
            "time_saved_seconds": f.get("time_saved", {}).get("total_seconds"),
            "quorum_short": f["quorum_short"]["count"] if "quorum_short" in f else None,
        }
