from guard.verifier_process.process import run

run()
