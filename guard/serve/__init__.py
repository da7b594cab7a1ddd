"""The sidecar: OIP data plane, mirror, admin API and the server that ties them together."""
