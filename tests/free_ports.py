"""Ports for the servers the tests start: one owner, so that two tests never race for one.

A port picked by binding port 0 comes from the kernel's ephemeral range (32768-60999 on Linux
by default), the same range every outgoing connection's local port is drawn from; between the
pick and the server's own bind, a client connection of any test beside it (xdist workers run
Triton, vLLM, Envoy and guards side by side) or another worker's pick can take it, and the
server exits with "Address already in use" (seen in CI for tritonserver). Ports here come from
below that range, from a block of its own for each xdist worker, each checked free by a bind
without SO_REUSEADDR (so that a port still in TIME_WAIT from an earlier server is passed over):
no outgoing connection and no other worker draws from the same ports.

Another pytest run on the same machine (its own workers, the same blocks) is the race left:
each process starts at a random place in its block, which makes a collision unlikely, and the
model-server fixtures still start again on new ports where one happens
(tests/model_server_process.py)."""

from __future__ import annotations

import itertools
import os
import random
import socket

# Below the ephemeral range and above the ports of well-known services on a developer's machine.
FIRST_PORT = 12000
BLOCK = 2000  # ports per xdist worker: a whole run takes a few hundred in one worker
BLOCKS = 10  # workers beyond ten share blocks (each port is still checked free)


def _worker_index() -> int:
    """0 for the controller or a run without xdist, N for worker ``gwN``."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


_BLOCK_START = FIRST_PORT + BLOCK * (_worker_index() % BLOCKS)
_OFFSET = random.randrange(BLOCK)
# This worker's block, round and round, from a random place in it.
_ports = (_BLOCK_START + (_OFFSET + i) % BLOCK for i in itertools.count())


def is_free(port: int) -> bool:
    """Nothing is bound to ``port`` on 127.0.0.1, nor lingering there in TIME_WAIT."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port of this worker's block that nothing holds now."""
    for _ in range(BLOCK):
        port = next(_ports)
        if is_free(port):
            return port
    raise RuntimeError(f"no free port in this worker's block of {BLOCK} from {_BLOCK_START}")
