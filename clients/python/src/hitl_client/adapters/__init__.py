"""Adapters of agent frameworks to the console. Each module imports its framework: `hitl_client` itself does not."""
