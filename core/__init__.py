"""The bottom layer: plain Python every layer (billing, provisioner, portal) may import. No Django
models here."""
