"""What both official runners share (conformance/official_medusa.py, official_eagle.py): the step recorder, and the
request loop (one request file's path per line on stdin, the result file's path on stdout). Runs in the official
environments only.

    rec = Recorder(module.update_inference_inputs)   # put in its place: records what each step appends
    serve(rec, decode)                               # decode(request) fills rec.steps
"""
import json
import sys
import time
from pathlib import Path


class Recorder:
    """Wraps the official update_inference_inputs: the tokens each step appends (root + accepted drafts)."""

    def __init__(self, original):
        self.original, self.steps = original, []

    def __call__(self, input_ids, candidates, best_candidate, accept_length, *rest):
        self.steps.append(candidates[best_candidate, : int(accept_length) + 1].tolist())
        return self.original(input_ids, candidates, best_candidate, accept_length, *rest)

    @property
    def emitted(self) -> int:
        return sum(len(s) for s in self.steps)


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
