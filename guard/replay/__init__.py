"""Replay: captured traffic or .npz input sets through the sidecar's checks, offline (run.py
chains source -> plan -> engines -> aggregate -> report)."""
