# Each API token gets its own callback signing secret (issue 24): the decisions POSTed to an agent's callback
# were all signed with one CALLBACK_SECRET, so any agent could sign what another would take as the console's.
# Tokens issued before get a secret each here (a column default would give them all the same one); nobody has
# seen it: `manage.py rotate_callback_secret PREFIX` shows a new one.

from django.db import migrations, models

import core.models


def give_each_token_a_secret(apps, schema_editor):
    ApiToken = apps.get_model("core", "ApiToken")
    for token in ApiToken.objects.filter(callback_secret="").only("pk"):
        ApiToken.objects.filter(pk=token.pk).update(callback_secret=core.models.new_callback_secret())


class Migration(migrations.Migration):
    dependencies = [
        ("core", "0002_channel_request_permissions"),
    ]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="callback_secret",
            field=models.CharField(default="", editable=False, max_length=100),
            preserve_default=False,
        ),
        migrations.RunPython(give_each_token_a_secret, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="apitoken",
            name="callback_secret",
            field=models.CharField(
                default=core.models.new_callback_secret,
                editable=False,
                help_text="Signs the callbacks of its user's approval requests (Standard Webhooks); shown once.",
                max_length=100,
            ),
        ),
    ]
