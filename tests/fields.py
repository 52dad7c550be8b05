"""Comparing two runs' reports: without the fields a run measures anew (times, dates), at any depth."""
from __future__ import annotations


def without(obj, keys):
    """obj less every dict entry whose key is in `keys`, inside dicts and lists at any depth."""
    if isinstance(obj, dict):
        return {k: without(v, keys) for k, v in obj.items() if k not in keys}
    if isinstance(obj, list):
        return [without(v, keys) for v in obj]
    return obj
