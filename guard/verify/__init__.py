"""Verification tiers: tensor (tier 1) today; activation and task tiers build on it."""
