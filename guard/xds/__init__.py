"""guard's own subset of Envoy's xDS API (proto/guard/xds/): see ext_proc.proto for why."""
