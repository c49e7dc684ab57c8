from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    name = "approvals"

    def ready(self):
        from approvals.gates import CardBackend
        from runs import gates

        gates.register(CardBackend())
