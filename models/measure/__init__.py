"""Measurement: tree calibration, the verify-step latency profile, MT-Bench speed summaries."""
