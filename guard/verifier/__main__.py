from guard.verifier.process import run

run()
