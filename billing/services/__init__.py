"""Writes of the billing app, one module per concern (ledger, pricing, metering, topups, cards)."""
