from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("runs", "0001_initial")]

    operations = [
        migrations.AddField(
            model_name="run",
            name="paused_switch",
            field=models.CharField(
                blank=True,
                help_text="The kill switch that paused the run (a channel's name, or '*' for the global one): releasing it resumes the run.",
                max_length=64,
            ),
        ),
    ]
