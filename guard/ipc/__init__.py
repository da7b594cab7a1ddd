"""What the serving process and the verifier process share, and how they talk.

- ``memory``: memfd-backed shared memory (no names to leak, freed with the last mapping);
- ``routes``: one route word per model (route, probing, epoch), written by the verifier and read
  by the request path with one aligned 8-byte load: no lock, no syscall;
- ``ring``: a bounded single-producer byte ring for sampled requests (full = dropped, counted);
- ``wire``: the binary layout of a sampled request inside the ring (no pickle of tensors);
- ``channel``: length-prefixed JSON messages for control (config, admin, events, metrics).
"""
