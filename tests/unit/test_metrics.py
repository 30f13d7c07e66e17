from livemig.lab.agent import AgentLink, RateSample
from livemig.metrics import longest_gap, rate_series, workload_stats


def _samples(rate, t0, t1, step=0.1, start_count=0, source="src"):
    out, t, c = [], t0, start_count
    while t <= t1 + 1e-9:
        out.append(RateSample(t=t, mem_bytes=int(c), disk_bytes=0, verify_blocks=0,
                              source=source))
        c += rate * step
        t += step
    return out


def test_longest_gap_merges_both_ends():
    src = [i * 0.01 for i in range(100)]  # 0 .. 0.99
    dst = [1.5 + i * 0.01 for i in range(50)]  # resumes at 1.5
    gap = longest_gap(src + dst, 0.2, 2.0)
    assert gap is not None
    assert abs(gap.seconds - 0.51) < 1e-6 and abs(gap.start - 0.99) < 1e-6


def test_longest_gap_none_without_beats():
    assert longest_gap([1.0], 0, 2) is None


def test_workload_stats_counts_the_dip():
    # 100 MB/s for 10 s, frozen for 1 s (no samples, counter does not move), then 100 MB/s
    before = _samples(100e6, 0.0, 10.0)
    after = _samples(100e6, 11.0, 15.0, start_count=before[-1].mem_bytes)
    st = workload_stats(before + after, 2.0, 8.0, 15.0)
    assert st.baseline_rate is not None and abs(st.baseline_rate - 100e6) / 100e6 < 0.01
    assert st.seconds_below_10pct is not None and 0.9 <= st.seconds_below_10pct <= 1.1
    assert st.min_rate is not None and st.min_rate < 1e6


def test_verification_hold_is_not_a_dip():
    before = _samples(100e6, 0.0, 10.0)
    after = _samples(100e6, 11.0, 15.0, start_count=before[-1].mem_bytes)
    st = workload_stats(before + after, 2.0, 8.0, 15.0, exclude=(10.0, 11.0))
    assert st.seconds_below_10pct == 0


def test_rate_series_constant():
    s = _samples(50e6, 0, 5)
    series = rate_series(s, 1.0, 4.0)
    assert len(series) == 30
    assert all(abs(r - 50e6) < 1e3 for _, r in series)


def test_agent_line_parsing():
    a = AgentLink("src", path=None)  # type: ignore[arg-type]
    a.handle_line('{"ev":"hb","seq":1,"t":5}', 10.0)
    a.handle_line('{"ev":"rate","seq":1,"t":5,"mem_bytes":4096,"disk_bytes":512}', 10.1)
    a.handle_line('{"ev":"verify_error","kind":"mem","addr":4096}', 10.2)
    a.handle_line("garbage", 10.3)
    a.handle_line('{"ev":"error","msg":"bad spec"}', 10.4)
    a.handle_line('{"ev":"ready"}', 10.5)
    assert a.heartbeats == [10.0]
    assert a.rates[0].work == 4608
    assert a.verify_errors[0]["addr"] == 4096
    assert a.errors == ["bad spec"]
    assert a.ready.is_set()


def test_work_lost_counts_depth_and_duration():
    from livemig.metrics import work_lost
    # 2 s at 50 % and 1 s at 0 % lose the same work: 1 s each
    half = [50.0] * 20
    stop = [0.0] * 10
    assert abs(work_lost(half, 100.0) - 1.0) < 1e-9
    assert abs(work_lost(stop, 100.0) - 1.0) < 1e-9
    # catching up above normal does not pay back a loss
    assert abs(work_lost(stop + [300.0] * 10, 100.0) - 1.0) < 1e-9
    assert work_lost([100.0] * 50, 100.0) == 0.0


def test_work_lost_net_lets_bins_above_normal_pay_back():
    from livemig.metrics import work_lost_net
    stop = [0.0] * 10
    assert abs(work_lost_net(stop + [300.0] * 5, 100.0)) < 1e-9
    assert abs(work_lost_net(stop, 100.0) - 1.0) < 1e-9
    noise = [90.0, 110.0] * 50  # a steady guest's own noise: nothing lost
    assert abs(work_lost_net(noise, 100.0)) < 1e-9
    assert work_lost_net(noise, 0.0) == 0.0


def test_workload_stats_reports_work_lost_and_spread():
    # 100 MB/s, frozen 1 s, then 100 MB/s: ~1 s of work lost, steady baseline
    before = _samples(100e6, 0.0, 10.0)
    after = _samples(100e6, 11.0, 15.0, start_count=before[-1].mem_bytes)
    st = workload_stats(before + after, 2.0, 8.0, 15.0)
    assert st.work_lost_s is not None and 0.9 <= st.work_lost_s <= 1.1
    assert st.baseline_spread_pct is not None and st.baseline_spread_pct < 1.0
    d = st.as_dict()
    assert "work_lost_s" in d and "baseline_spread_pct" in d


def test_spread_of_an_unsteady_rate_is_large():
    from livemig.metrics import spread_pct
    fast = _samples(100e6, 0.0, 1.0)
    slow = _samples(20e6, 1.1, 2.0, start_count=fast[-1].mem_bytes)
    fast2 = _samples(100e6, 2.1, 3.0, start_count=slow[-1].mem_bytes)
    sp = spread_pct(fast + slow + fast2, 0.0, 3.0)
    assert sp is not None and sp > 30
