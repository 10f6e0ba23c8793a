"""How the Locust client judges one streamed reply (loadtest/locustfile.py's StreamResult), in a
subprocess: the locustfile imports Locust, whose gevent monkey-patching must stay out of the test
process. An empty reply that ends properly (the model's first token was its end of sequence) is a
success without TTFT; a stream with no text that never says why it finished is a failure."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.serving.conftest import REPO

SCRIPT = """
import json, sys
sys.path.insert(0, "loadtest")
from locustfile import StreamResult
out = {}
for name, events in json.loads(sys.argv[1]).items():
    r = StreamResult()
    for i, event in enumerate(events):
        r.feed(event, float(i))
    r.done = True
    out[name] = [r.empty_reply, r.first_token_s]
print(json.dumps(out))
"""


def test_an_empty_reply_that_ends_properly_is_not_a_missing_token():
    cases = {
        "empty": [{"choices": [{"index": 0, "text": ""}]}, {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}],
        "text": [{"choices": [{"index": 0, "text": "Hi"}]}, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}],
        "silent": [{"choices": [{"index": 0, "text": ""}]}],
    }
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["empty"] == [True, None]
    assert got["text"] == [False, 0.0]
    assert got["silent"] == [False, None]
