import sys

from guard.verifier.process import main

sys.exit(main())
