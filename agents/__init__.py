"""The Suanli node agent: one per GPU host.

It reports NVML inventory and metrics, carves GPUs into plans, runs Jupyter workloads through a
runtime, and speaks to the portal only over HTTP (docs/AGENT_PROTOCOL.md). It never imports Django
or the portal apps.
"""

__version__ = "0.1.0"
