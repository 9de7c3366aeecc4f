"""Harness integrations, one module per harness; installed as `agent_monitor.adapters`."""
