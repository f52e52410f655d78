"""bench.common.plots writes real PNGs, and `python -m bench.serving` writes JSON + plots end to end."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from bench.common import plots
from bench.common.metrics import RequestResult, summarize
from bench.serving import main
from tests.bench.test_client import FakeState, fake  # noqa: F401 - the fixture
from tests.tiny_models import make_tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _results() -> list[RequestResult]:
    return [RequestResult(True, 0.0, 100, 4, 4, 10 * i, [0.1 * i + 0.01 * k for k in range(4)],
                          0.1 * i + 0.05) for i in range(1, 6)]


def test_plots_are_pngs(tmp_path: Path) -> None:
    results = _results()
    paths = plots.plot_run(results, tmp_path / "run")
    s = summarize(results, 1.0)
    paths.append(plots.plot_sweep([1.0, 2.0, float("inf")], [s, s, s], tmp_path / "sweep.png"))
    figures = [{"output_tok_s": 10.0, "ttft_p50_ms": 5.0, "ttft_p99_ms": 9.0},
               {"output_tok_s": 20.0, "ttft_p50_ms": None, "ttft_p99_ms": 3.0}]
    paths.append(plots.plot_compare(["a", "b"], figures, tmp_path / "cmp.png"))
    assert [p.name for p in paths] == ["run_latency.png", "run_hitrate.png", "sweep.png",
                                       "cmp.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000


async def test_serving_cli_sweep_writes_json_and_plots(
        fake: tuple[str, FakeState], tmp_path: Path) -> None:  # noqa: F811
    url, st = fake
    tok_dir = tmp_path / "tok"
    make_tokenizer().save_pretrained(tok_dir)
    out = tmp_path / "out"
    argv = ["--base-url", url, "--tokenizer", str(tok_dir), "--prompts-per-group", "3",
            "--system-prompt-len", "20", "--question-len", "4", "--output-len", "2",
            "--sweep", "50,inf", "--disable-tqdm", "--output-dir", str(out)]
    rc = await asyncio.to_thread(main, argv)
    assert rc == 0
    record = json.loads(next(out.glob("serving_shared-prefix_*.json")).read_text())
    assert record["rates"] == [50.0, "inf"]
    assert record["runs"][1]["config"]["request_rate"] == "inf"
    assert [r["summary"]["completed"] for r in record["runs"]] == [3, 3]
    assert record["runs"][0]["requests"][0]["prompt_len"] == 24
    assert record["runs"][0]["summary"]["hit_rate"] is not None
    assert len(list(out.glob("*.png"))) == 3  # latency, hit rate, sweep
    # The first point warmed the server once; the second point sent no warm-up.
    assert sum(len(b["prompt"]) == 24 for b in st.bodies) == 3 + 3 + 1
