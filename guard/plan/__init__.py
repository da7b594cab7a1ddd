"""The plan step: a config checked against what the layers above config/ declare.

config/ validates the document's own schema and imports nothing of guard (it is a leaf). What a
backend, a tier or the op repair can do is declared by its own layer; this step holds the
config against those declarations and names each problem as ``dotted.path: message``:

- ``serving``: against the backends' declarations (guard/backends/kind.py: the registered names,
  precisions, options, artifacts, checks of a block, a model, the whole config). What every
  serving process runs at load: it imports backends' declarations only, nothing of verify/ or
  policy/.
- ``complete``: ``serving`` and the checks' registries (the adapters, tier 2's capture, the
  repair's strategies). What `guard config validate`, the verifier process, replay and the
  matrix run.
- ``schema``: the JSON schema of `guard config schema`, with the registered names filled in.

Nothing is imported here: a serving process imports ``guard.plan.serving`` alone.
"""
