"""`lockstep check`: the determinism harness, for Lockstep and any OpenAI-compatible server.

client.py (HTTP), compare.py (bitwise comparison, per-scenario tally), scenarios.py (one
function per scenario), runner.py (budget, order), report.py (table, JSON, plot), serve.py
(`--serve`: Lockstep as a subprocess), cli.py (the subcommand). See docs/check.md.
"""
