"""bench.compare: the ratio table, medians, and the subprocess lifecycle on loopback."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from bench.common.client import BenchError
from bench.common.compare_report import FIGURES, format_table, median_figures
from bench.common.metrics import RequestResult, summarize
from bench.common.server_process import ServerProcess, SystemSpec
from bench.compare import main


def _summary(ttft: float, n_tokens: int, duration: float, cached: int) -> object:
    chunks = [ttft + 0.01 * i for i in range(n_tokens)]
    r = RequestResult(True, 0.0, 100, n_tokens, n_tokens, cached, chunks, chunks[-1])
    return summarize([r], duration)


def test_median_figures_per_figure() -> None:
    runs = [_summary(0.1, 10, 1.0, 50), _summary(0.3, 10, 2.0, 0), _summary(0.2, 10, 4.0, 100)]
    fig = median_figures(runs)  # type: ignore[arg-type]
    assert fig["output_tok_s"] == pytest.approx(5.0)  # median of 10, 5, 2.5
    assert fig["ttft_p50_ms"] == pytest.approx(200.0)
    assert fig["hit_rate_pct"] == pytest.approx(50.0)
    assert fig["failed"] == 0
    assert set(FIGURES) <= set(fig)


def test_table_shows_ratios_to_the_reference() -> None:
    ref = dict.fromkeys(FIGURES, 10.0) | {"failed": 0.0}
    other = dict.fromkeys(FIGURES, 20.0) | {"failed": 1.0, "hit_rate_pct": None}
    table = format_table({"radixserve": ref, "peer": other, "broken": "exited with 1"},
                         "radixserve")
    lines = table.splitlines()
    assert lines[0].split()[0] == "system" and set(lines[1]) == {"-"}
    assert "10.0 (1.00x)" in lines[2]
    assert "20.0 (2.00x)" in lines[3] and "n/a" in lines[3]
    assert lines[4].startswith("broken") and "did not run: exited with 1" in lines[4]
    # Without the reference in the table, figures stand alone.
    assert "x)" not in format_table({"peer": other}, "radixserve")


def test_server_process_that_dies_is_reported(tmp_path: Path) -> None:
    spec = SystemSpec("dies", (sys.executable, "-c", "raise SystemExit(3)"),
                      startup_timeout_s=30)
    with pytest.raises(BenchError, match="exited with 3"), ServerProcess(spec, tmp_path / "l"):
        pass


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status  # a zombie waiting for its reaper is dead


def test_server_process_is_stopped_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    code = ("import http.server, subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
            "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    spec = SystemSpec("http", (sys.executable, "-c", code, "{port}"), startup_timeout_s=30)
    with ServerProcess(spec, tmp_path / "http.log") as server:
        assert server.proc is not None and server.proc.poll() is None
        assert server.base_url.startswith("http://127.0.0.1:")
        child = int(pid_file.read_text())
        assert _alive(child)
    assert server.proc.poll() is not None  # terminated on exit
    # The process group went with it (a signal is delivered asynchronously: allow a moment).
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


@pytest.mark.slow
def test_compare_end_to_end_on_hf_baselines(tiny_llama: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--model", str(tiny_llama), "--systems", "hf-batch",
               "--num-groups", "1", "--prompts-per-group", "4", "--system-prompt-len", "20",
               "--question-len", "4", "--output-len", "4", "--disable-tqdm",
               "--output-dir", str(tmp_path), "--runs", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "hf-batch" in out and "warm-up" in out
    record = json.loads(next(tmp_path.glob("compare_*.json")).read_text())
    for name in ("hf-batch",):
        sysrec = record["systems"][name]
        assert len(sysrec["runs"]) == 2
        assert sysrec["figures"]["failed"] == 0
        assert all(r["summary"]["total_output_tokens"] == 16 for r in sysrec["runs"])
    assert list(tmp_path.glob("compare_*.png"))
    assert len(list(tmp_path.glob("compare_*.log"))) == 1


def test_interleave_runs_every_system_once_per_round(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    import argparse

    from bench import compare

    calls: list[tuple[str, list[str], str]] = []

    def fake_run_system(spec: SystemSpec, workloads: list[str], args: object,
                        log_path: Path) -> tuple[list[str], list[str]]:
        calls.append((spec.name, list(workloads), log_path.name))
        if spec.name == "broken":
            raise BenchError("no server")
        return [f"{spec.name}:{w}" for w in workloads], ["cost"] * len(workloads)

    monkeypatch.setattr(compare, "run_system", fake_run_system)
    systems = [SystemSpec("a", ("x",)), SystemSpec("broken", ("y",)), SystemSpec("b", ("z",))]
    res = compare._run_all(systems, ["w0", "w1", "w2"],  # type: ignore[arg-type]
                           argparse.Namespace(interleave=True), tmp_path, "s")
    # The order rotates by run (so going first favours no one); a failed system is not retried.
    assert [(n, w) for n, w, _ in calls] == [
        ("a", ["w0"]), ("broken", ["w0"]), ("b", ["w0"]),
        ("b", ["w1"]), ("a", ["w1"]), ("b", ["w2"]), ("a", ["w2"])]
    assert calls[0][2] == "s_a_0.log" and calls[-1][2] == "s_a_2.log"
    assert res == {"a": (["a:w0", "a:w1", "a:w2"], ["cost"] * 3), "broken": "no server",
                   "b": (["b:w0", "b:w1", "b:w2"], ["cost"] * 3)}
    calls.clear()
    res = compare._run_all(systems[:1], ["w0", "w1"],  # type: ignore[arg-type]
                           argparse.Namespace(interleave=False), tmp_path, "s")
    assert [(n, w) for n, w, _ in calls] == [("a", ["w0", "w1"])]
