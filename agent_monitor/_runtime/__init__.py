"""The runtime plumbing every layer may use: the background loop, sync-over-async, time budgets,
the scheduler, token estimates, a lean HTTP client."""
