"""Envoy as guard's data plane (``server.data_plane: envoy``): the bootstrap, the supervised
process, route switching, stats and the observer. See docs/envoy.md."""
