"""The verifier process: reference, checks, detectors, capture and repair, out of the serving
process (guard/verifier_process/process.py)."""
