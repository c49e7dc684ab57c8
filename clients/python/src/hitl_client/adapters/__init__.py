"""Adapters to agent frameworks. Each module imports its framework itself (install the extra named after it), so
that `hitl_client` works without any of them."""
