"""The Open Inference Protocol below the message classes: what backends and the serving path
both need to speak it (``raw``: reading and re-addressing serialized messages without parsing
them)."""
