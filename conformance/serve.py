"""The request loop both official runners share (conformance/official_medusa.py, official_eagle.py): one request
file's path per line on stdin, the result file's path on stdout. Runs in the official environments only.

    serve(rec, decode)    # decode(request) fills rec.steps with what each step appended
"""
import json
import sys
import time
from pathlib import Path


def serve(rec, decode) -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        path = Path(line.strip())
        req = json.loads(path.read_text())
        rec.steps = []
        t0 = time.perf_counter()
        decode(req)
        seconds = time.perf_counter() - t0
        out = {"steps": rec.steps, "new_tokens": [t for s in rec.steps for t in s], "seconds": seconds}
        result = path.with_suffix(".result.json")
        result.write_text(json.dumps(out))
        print(result, flush=True)
