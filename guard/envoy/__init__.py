"""guard beside Envoy: Envoy forwards the calls, guard watches (``observer``) and steers."""
