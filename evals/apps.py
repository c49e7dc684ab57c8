"""Offline evaluations of candidate approval rules over recorded cards (docs/evaluate.md)."""

from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "evals"
    verbose_name = "evaluations"
