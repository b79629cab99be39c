from kvstrata_lab.bench.trace_sim import TraceConfig, simulate


def test_roomy_pool_keeps_every_live_state():
    r = simulate(TraceConfig(sessions=60, turns=6, think_user_s=5, ttl_s=3600, pool_bytes=10**12))
    assert r["outcomes"]["miss"] == 60 and r["outcomes"]["replay"] == 0
    assert r["swa_hit_rate_after_first_turn"] == 1.0


def test_small_pool_evicts_and_replays():
    r = simulate(TraceConfig(sessions=60, turns=6, arrival_span_s=10, ttl_s=3600, pool_bytes=5 * 2_000_000))
    assert r["swa_evicted_for_capacity"] > 0 and r["outcomes"]["replay"] > 0
    assert r["peak_swa_pool_bytes"] <= 5 * 2_000_000


def test_short_ttl_expires_states():
    r = simulate(TraceConfig(sessions=60, turns=6, think_user_s=600, ttl_s=1, pool_bytes=10**12))
    assert r["swa_expired"] > 0 and r["outcomes"]["replay"] > 0
    assert r["ttft_s"]["p99"] >= r["ttft_s"]["p50"]
