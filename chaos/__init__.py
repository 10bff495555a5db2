"""Fault injection for the whole product (``make chaos``) and the stack that ``make load`` shares.

- ``chaos.stack``: the real processes on a data directory of their own (embedded PostgreSQL and Redis,
  web, Celery workers and beat, node agents on fake fleets, a delaying TCP proxy in front of one agent),
  and the seed of a small world (catalog, prices, nodes, users with tokens and logins).
- ``chaos.traffic``: users launching, using (HTTP and WebSocket through the Jupyter proxy) and stopping.
- ``chaos.faults``: the schedule of faults and the code that injects each one.
- ``chaos.checks``: what must hold afterwards, read from the database (and the agents' own lists).
- ``chaos.run``: the driver; writes docs/RELIABILITY.md and exits non-zero on any failed check.
"""
