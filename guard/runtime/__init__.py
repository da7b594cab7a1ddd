"""What both processes (serving and verifier) share at run time without importing each other:
which requests are sampled (``sampling``: a keyed hash both sides compute alike) and how
background threads yield the CPU to the request path (``priority``)."""
