"""Policy: decides, from check results, which backend answers a model's requests."""
