"""One module per DVC stage: `python -m pipelines.<stage> group=option key=value`."""
