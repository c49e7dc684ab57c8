from django.core.management.base import BaseCommand, CommandError

from console.models import AuditEntry


class Command(BaseCommand):
    help = "Check the audit log's hash chain; exit non-zero at the first break."

    def handle(self, *args, **options):
        checked = AuditEntry.objects.count()
        for entry, problem in AuditEntry.verify_chain():
            raise CommandError(
                f"audit log broken at entry {entry.pk} ({entry.at:%Y-%m-%d %H:%M:%S} "
                f"{entry.action} by {entry.actor}): {problem}"
            )
        self.stdout.write(f"audit log intact: {checked} entries")
