"""KVCacheAwareRouter on a real Ray Serve app with 2 LLMServer replicas.

One replica is preloaded, bypassing the router, with two long requests (900-token prompts): a big KV
footprint. The other gets two thin ones (16-token prompts), so both replicas have the same number of
requests in flight and a queue-length router (Serve's power of two) would see them as equal. Short
requests then go through the HTTP API: the router reads the published KV occupancy and must send at
least 90% of them to the other replica. Which replica ran each request comes from the replica probe.
"""

from __future__ import annotations

import random
import time

import pytest

from tests.router.ray_helpers import llm_replicas, router_app_args, serve_app, shorts_after_preload

pytestmark = pytest.mark.timeout(600)

NUM_SHORT = 20


def test_short_requests_avoid_the_replica_full_of_long_ones(local_ray, probe_dir):
    rng = random.Random(0)
    started = time.monotonic()
    with serve_app(router_app_args()) as base_url:
        print(f"\n[router] app ready in {time.monotonic() - started:.1f} s")
        replicas = llm_replicas()
        assert len(replicas) == 2
        loaded, other = sorted(replicas)
        before, after, served = shorts_after_preload(base_url, replicas, loaded, other, probe_dir, rng, NUM_SHORT)
    on_other = sum(1 for replica in served.values() if replica == other)
    print(f"[router] KV usage before: loaded {before[loaded]['kv_cache_usage']:.2f}, other "
          f"{before[other]['kv_cache_usage']:.2f}; after: {after[loaded]['kv_cache_usage']:.2f} / "
          f"{after[other]['kv_cache_usage']:.2f}; short requests on the other replica: {on_other}/{NUM_SHORT}")
    assert len(served) == NUM_SHORT, f"requests missing from the probes: {sorted(served)}"
    # the long requests were still there the whole time (else the test proves nothing)
    assert after[loaded]["kv_cache_usage"] >= 0.4 and after[loaded]["kv_cache_usage"] > after[other]["kv_cache_usage"]
    assert on_other >= 0.9 * NUM_SHORT, f"only {on_other}/{NUM_SHORT} short requests avoided the loaded replica"
