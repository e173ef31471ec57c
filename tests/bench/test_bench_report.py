"""The bench's arithmetic and report (loadtests/bench.py, bench_report.py, bench_load.py), on made-up cells.

A wrong ratio or a "met" on a missed goal would mislead every reader of RESULTS.md, so the figures the
issue's goals are judged by are checked against values computed by hand here.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from loadtests import bench_load, bench_report
from loadtests.bench import summarize
from loadtests.loadgen import Target


def row(mode: str, conc: int, cand: str, rps: float, p50: float, rep: int = 0, errors: int = 0) -> dict:
    return {"rep": rep, "mode": mode, "conc": conc, "candidate": cand, "rps": rps, "p50_ms": p50,
            "p99_ms": p50 * 3, "errors": {"x": errors} if errors else {}, "proxy_cpu": 0.5, "client_cpu": 0.1}


ROWS = [
    row("https", 1, "direct", 5000, 0.2), row("https", 1, "direct", 7000, 0.4, rep=1),
    row("https", 1, "squid", 4000, 0.3), row("https", 1, "squid", 3000, 0.3, rep=1),
    row("https", 1, "mitmdump", 500, 1.6), row("https", 1, "mitmdump", 300, 2.0, rep=1),
    row("https", 1, "egressgate", 450, 1.2), row("https", 1, "egressgate", 430, 1.4, rep=1, errors=2),
    row("https", 1, "egressgate-pt", 1900, 0.6), row("https", 1, "egressgate-pt", 1600, 0.8, rep=1),
    {"rep": 2, "mode": "https", "conc": 1, "candidate": "egressgate", "failed": "worker hung"},
]


def meta(noisy: list[str] | None = None) -> dict:
    sample = {"loadavg": [0.5, 0.4, 0.3], "others_pct": 2.0, "steal_pct": 0.0, "cpus": 2}
    return {"command": "x", "started": "now", "git": "abc", "mitmproxy": "12.3.1", "squid": "5.7",
            "python": "3.13", "load_start": sample, "load_end": sample, "noisy": noisy or [],
            "load_run": {"wall_s": 10.0, "bench_cores": 1.5, "others_cores": 0.1, "steal_pct": 0.0, "cpus": 2}}


def test_summary_is_medians_and_counts_failed_cells_as_errors() -> None:
    s = {x["candidate"]: x for x in summarize(ROWS)}
    assert s["direct"]["rps"] == 6000 and s["direct"]["p50_ms"] == pytest.approx(0.3)
    assert s["egressgate"]["rps"] == 440 and s["egressgate"]["runs"] == [450, 430]
    assert s["egressgate"]["errors"] == 3  # 2 bad responses + 1 failed cell
    assert [x["candidate"] for x in summarize(ROWS)] == ["direct", "squid", "mitmdump", "egressgate",
                                                         "egressgate-pt"]


def test_ratios_use_the_right_reference() -> None:
    (r,) = bench_report.ratios(summarize(ROWS))
    assert r["eg_vs_mitmdump"] == pytest.approx(440 / 400)
    assert r["pt_vs_squid"] == pytest.approx(1750 / 3500)
    assert r["eg_added_p50_ms"] == pytest.approx(1.3 - 0.3)
    assert r["mitmdump_added_p50_ms"] == pytest.approx(1.8 - 0.3)
    # every row has proxy CPU 0.5: per CPU-second the ratio is the same
    assert r["eg_vs_mitmdump_per_cpu"] == pytest.approx(440 / 400)


def test_missing_candidates_give_no_ratio_rather_than_a_wrong_one() -> None:
    (r,) = bench_report.ratios(summarize([x for x in ROWS if x["candidate"] in ("direct", "egressgate")]))
    assert r["eg_vs_mitmdump"] is None and r["pt_vs_squid"] is None and r["eg_added_p50_ms"] is not None


def test_markdown_marks_goals_and_unavailable_cells() -> None:
    bulk = [{"rep": 0, "candidate": "squid", "bytes": 1 << 30, "seconds": 2.0, "mib_per_s": 512.0, "ok": True,
             "error": None, "proxy_cpu_s": 1.0, "client": "curl"},
            {"rep": 0, "candidate": "egressgate", "bytes": 1 << 30, "seconds": 8.0, "mib_per_s": 128.0, "ok": True,
             "error": None, "proxy_cpu_s": 8.0, "client": "curl", "rss_before_mb": 90.0, "peak_rss_mb": 190.5},
            {"rep": 0, "candidate": "egressgate-pt", "bytes": 1 << 30, "seconds": 4.0, "mib_per_s": 256.0,
             "ok": True, "error": None, "proxy_cpu_s": 3.0, "client": "curl", "rss_before_mb": 90.0,
             "peak_rss_mb": 95.0}]
    md = bench_report.markdown({"meta": meta(["others used 1.2 cores"]), "summary": summarize(ROWS), "bulk": bulk,
                                "unavailable": {"mitmdump": "did not start"}})
    line = next(x for x in md.splitlines() if x.startswith("| https | 1 | 1.10x"))
    assert "1.10x (met)" in line and "1.00 ms (met)" in line and "0.50x (met)" in line
    assert "90.0 -> 190.5 (**not met**)" in md  # peak RSS over 180 MB
    assert "Passthrough / Squid bulk MiB/s: 0.50x (met)" in md
    assert "**Noisy run" in md and "others used 1.2 cores" in md
    assert "mitmdump: not available (did not start)." in md


def test_noisy_thresholds() -> None:
    quiet = {"others_pct": 10.0, "steal_pct": 1.0}
    assert bench_load.noisy(quiet, quiet, {"others_cores": 0.2, "steal_pct": 0.0}) == []
    assert len(bench_load.noisy({"others_pct": 40.0, "steal_pct": 9.0}, quiet,
                                {"others_cores": 0.9, "steal_pct": 0.0})) == 3


def test_plot_writes_a_png_or_says_why_not(tmp_path: Path) -> None:
    """With the `bench` extra (matplotlib) a PNG is written; without it (`make test` installs only `dev`)
    the plot says what to install and writes nothing, and the bench still writes its table."""
    path = tmp_path / "b.png"
    why = bench_report.plot({"meta": meta(), "summary": summarize(ROWS), "bulk": []}, path)
    if importlib.util.find_spec("matplotlib") is not None:
        assert why is None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in why and not path.exists()


def test_plot_without_matplotlib_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    path = tmp_path / "b.png"
    why = bench_report.plot({"meta": meta(), "summary": summarize(ROWS), "bulk": []}, path)
    assert why is not None and "pip install -e '.[bench]'" in why and not path.exists()


@pytest.mark.parametrize("addr", ["10.0.0.1", "198.20.0.1", "169.254.169.254", "8.8.8.8"])
def test_load_generator_dials_only_loopback_or_the_bench_range(addr: str) -> None:
    with pytest.raises(ValueError, match=r"loopback or 198\.18\.0\.0/15"):
        Target(scheme="http", host="h", port=80, dial=(addr, 80), via_proxy=False)
    for ok in ("127.0.0.1", "198.18.0.1", "198.19.255.254"):
        Target(scheme="http", host="h", port=80, dial=(ok, 80), via_proxy=False)


def test_record_appends_and_keeps_what_was_there(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\nolder section\n")
    bench_report.record("### `make bench` run, now\n\n| a |", results)
    text = results.read_text()
    assert text.startswith("# Benchmark results\n\nolder section\n") and text.endswith("| a |\n")


def test_egressgate_mitm_is_set_against_squid_ssl_bump_with_the_goal_at_c32() -> None:
    """Issue 25: egressgate's MITM rate as a fraction of Squid ssl-bump's, goal >= 0.5x marked at c=32 only,
    and both added p50s at c=1."""
    rows = [row("https", 1, "direct", 9000, 0.1), row("https", 1, "squid-bump", 3000, 0.3),
            row("https", 1, "egressgate", 800, 1.2),
            row("https", 32, "direct", 30000, 1.0), row("https", 32, "squid-bump", 5000, 6.0),
            row("https", 32, "egressgate", 1000, 30.0)]
    by = {r["conc"]: r for r in bench_report.ratios(summarize(rows))}
    assert by[1]["eg_vs_squid_bump"] == pytest.approx(800 / 3000)
    assert by[1]["squid_bump_added_p50_ms"] == pytest.approx(0.2)
    assert by[32]["eg_vs_squid_bump"] == pytest.approx(0.2)
    md = bench_report.markdown({"meta": meta(), "summary": summarize(rows), "bulk": []})
    assert "squid (ssl-bump MITM)" in md
    line1 = next(x for x in md.splitlines() if x.startswith("| https | 1 | -"))
    line32 = next(x for x in md.splitlines() if x.startswith("| https | 32 | -"))
    assert by[32]["eg_vs_squid_bump_per_cpu"] == pytest.approx(0.2)  # every row: proxy CPU 0.5
    assert "0.27x |" in line1 and "0.20 ms" in line1 and "met" not in line1.split("|")[-4]
    assert "0.20x (**not met**)" in line32
    rows[4] = row("https", 32, "squid-bump", 1800, 6.0)
    md = bench_report.markdown({"meta": meta(), "summary": summarize(rows), "bulk": []})
    assert "0.56x (met)" in next(x for x in md.splitlines() if x.startswith("| https | 32 | -"))


def test_baseline_tree_is_compared_in_its_own_table() -> None:
    rows = [row("http", 1, "direct", 9000, 0.1), row("http", 1, "egressgate", 1100, 0.9),
            row("http", 1, "egressgate-base", 1000, 1.1)]
    (r,) = bench_report.ratios(summarize(rows))
    assert r["eg_vs_base"] == pytest.approx(1.1) and r["base_added_p50_ms"] == pytest.approx(1.0)
    md = bench_report.markdown({"meta": meta(), "summary": summarize(rows), "bulk": []})
    assert "| http | 1 | 1.10x | 1.10x | 0.80 ms | 1.00 ms |" in md
    assert "egressgate, baseline tree (plain HTTP)" in md
    # no baseline in the run: no such table
    md = bench_report.markdown({"meta": meta(), "summary": summarize(rows[:2]), "bulk": []})
    assert "baseline tree" not in md


def test_baseline_candidate_runs_only_with_a_baseline_tree(tmp_path: Path) -> None:
    from loadtests import bench_procs
    from loadtests.bench import parse

    assert "egressgate-base" not in parse([]).candidates
    assert "egressgate-base" not in parse(["--candidates", "direct", "egressgate-base"]).candidates
    assert parse(["--baseline", str(tmp_path), "--candidates", "direct"]).candidates == ["direct", "egressgate-base"]
    # a tree without the package is refused before anything starts (the run then says "not available")
    with pytest.raises(RuntimeError, match="no egressgate/ package"):
        bench_procs.start_egressgate_baseline(None, tmp_path, tmp_path / "ca.pem", 1, 2, tree=tmp_path)
