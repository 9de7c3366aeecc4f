"""`python -m agent_monitor` runs the command line."""

from .cli import main

raise SystemExit(main())
