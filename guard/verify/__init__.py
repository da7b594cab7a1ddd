"""Verification tiers: tensor (tier 1, ``tensor.py``), activation (tier 2, ``activation/``) and
task (tier 3, ``task/``), run for one sample by ``pipeline.Comparator``."""
