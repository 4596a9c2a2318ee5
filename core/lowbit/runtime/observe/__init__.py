"""Seeing what a run does: the FP8 report, FP8 telemetry, profiling and experiment trackers."""
