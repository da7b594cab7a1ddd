"""The Open Inference Protocol below the message classes: what backends and the serving path
both need to speak it (``tensors``: specs and datatypes, ``codec``: OIP messages <-> numpy,
``inputs``: a request's inputs against a model's signature, ``raw``: reading and re-addressing
serialized messages without parsing them)."""
