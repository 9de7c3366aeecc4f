"""The offline tools: score recorded runs, evaluate policies and baselines on them (nothing live
imports them)."""
