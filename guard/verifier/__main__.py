"""``python -m guard.verifier``: the verifier process, started by ``guard serve``.

After ``main()`` has returned (capture flushed, channel closed) the process does what the
interpreter's exit would, minus the teardown of every module: it waits for any thread that is
not a daemon and runs the atexit handlers (logging, OpenTelemetry's exporters), then leaves
with ``os._exit``. That teardown (torch's hundreds of thousands of objects freed one by one)
took 2-3 s per stop, and the serving process waits for it at every shutdown and restart.
"""

import atexit
import os
import sys
import threading

from guard.verifier.process import main

code = main()
for thread in threading.enumerate():
    if thread is not threading.main_thread() and not thread.daemon:
        thread.join()
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
