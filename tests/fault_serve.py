"""`python -m scripts.serve` with its decoder slowed or made to fail, for the server's failure and burst tests;
started as the server is, with the same arguments.

MEGALITE_SERVE_STEP_S: seconds each decoder step (prefill or decode) waits first: a larger model's pace, so a burst
of requests outlasts its own arrival and a test can see requests running and waiting. MEGALITE_SERVE_FAULT: a
path; the first step taken once that file exists raises, as a fault in the model would (the scheduler's thread
dies with it).
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model.generate import CachedDecoder, WindowDecoder
from scripts import serve

FAULT = "injected fault in the decoder"


def slowed(method, seconds: float, trigger: str | None):
    def run_or_fail(self, *args, **kwargs):
        time.sleep(seconds)
        if trigger and os.path.exists(trigger):
            raise RuntimeError(FAULT)
        return method(self, *args, **kwargs)
    return run_or_fail


if __name__ == "__main__":
    delay, trigger = float(os.environ.get("MEGALITE_SERVE_STEP_S", "0")), os.environ.get("MEGALITE_SERVE_FAULT")
    for decoder in (WindowDecoder, CachedDecoder):  # CachedDecoder's methods do not call WindowDecoder's
        decoder.start, decoder.step = slowed(decoder.start, delay, trigger), slowed(decoder.step, delay, trigger)
    sys.exit(serve.main())
