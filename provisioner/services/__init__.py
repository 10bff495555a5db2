"""Writes of the provisioner: one module per concern (nodes, placement, quotas, sessions, heartbeats)."""
