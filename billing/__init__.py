"""Billing: accounts, the double-entry ledger, pricing, metering, compute cards and Stripe top-ups."""
