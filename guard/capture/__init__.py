"""Capture: sampled traffic recorded to segment files (writer), read back with resync (segment),
summarised (inspect), and input sets imported from .npz (npz). ``guard replay`` reads these."""
