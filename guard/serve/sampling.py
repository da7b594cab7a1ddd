"""Which requests are handed to the verifier (mirror) or recorded (capture).

With a request id the decision is a hash of the id (blake2b), so every replica and every serving
process picks the same requests, and a capture rate at or below the mirror rate captures only
mirrored requests; without one it is a random draw.
"""

from __future__ import annotations

import hashlib
import random


def sampled(request_id: str, rate: float) -> bool:
    """Should this request be taken? Deterministic in ``request_id`` when one is given."""
    if rate >= 1.0:
        return True
    if rate <= 0.0:
        return False
    if request_id:
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64 < rate
    return random.random() < rate
