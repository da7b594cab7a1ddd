"""guard beside Envoy (``server.data_plane: envoy``): Envoy forwards the calls, guard watches
(``observer``, ``hand_off``) and steers (``routes``); ``bootstrap`` writes Envoy's config,
``process`` supervises it, ``stats`` reads its request metrics back. See docs/envoy.md."""
