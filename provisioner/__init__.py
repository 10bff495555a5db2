"""Provisioner: nodes, GPUs and slices, placement, sessions and the tasks that drive node agents."""
