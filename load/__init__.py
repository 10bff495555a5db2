"""``make load``: 50 concurrent users against the dashboard, the launch API and the Jupyter proxy."""
