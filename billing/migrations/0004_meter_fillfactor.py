# Storage parameters for the rows every metering tick rewrites: free room on each page lets PostgreSQL
# update them in place (HOT updates, no index writes), which keeps the tick's one UPDATE pass cheap.

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("billing", "0003_ledger_pricing_metering_cards")]

    operations = [
        migrations.RunSQL(
            "ALTER TABLE billing_meter SET (fillfactor = 50); "
            "ALTER TABLE billing_ledgeraccount SET (fillfactor = 70);",
            "ALTER TABLE billing_meter RESET (fillfactor); "
            "ALTER TABLE billing_ledgeraccount RESET (fillfactor);",
        ),
    ]
