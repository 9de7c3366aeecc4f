"""`python -m agent_monitor`: the command line."""

from .cli import main

raise SystemExit(main())
