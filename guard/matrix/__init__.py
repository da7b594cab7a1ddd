"""``guard matrix FILE``: the configuration-first offline sweep (models x backends x tolerances
x tiers). ``config.py`` reads the YAML, ``runner.py`` runs the checks and writes one JSONL record
per check, ``report.py`` writes the summary tables and the heat map."""
