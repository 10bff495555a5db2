"""What every layer shares: the error family, staff permissions, the database clock and units.

The bottom of the layers (portal → provisioner → billing → core, checked by import-linter): it imports
none of the apps above and holds no models.
"""
