"""Host work per engine step: a model whose forward costs almost nothing, so a step's time is
the engine's own Python (scheduling, input building, sampling, output processing).

    python -m bench.overhead                         # CPU, batches 1, 64, 256
    python -m bench.overhead --device cuda
    python -m bench.overhead --baseline /tmp/base    # another source tree, side by side
    python -m bench.overhead --simulated-device-ms 5 # overlap on/off over a 5 ms forward

Decode: B requests (16-token prompts, greedy, ignore_eos) are admitted and prefilled, then
`--steps` decode steps are timed (the whole `Engine.step()`, and the model forward inside it);
the growth per request per step is the slope between batch sizes. Admission: N requests
queued at once, the time of the scheduling call that admits them all (N = 256 and 1024:
linear work gives a ratio of 4). With --baseline each source tree runs in its own subprocess,
alternating round by round, so both see the same machine load; the table is the median.
Does not know: the HTTP server (bench.http_overhead measures that side).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
PROMPT_LEN = 16
VOCAB = 1024


def build_model(workdir: Path) -> Path:
    sys.path.insert(0, str(HERE))
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(workdir / "overhead_llama", hidden_size=64, num_layers=2,
                           vocab_size=VOCAB, max_position_embeddings=2048)


def _engine(model: str, device: str, max_reqs: int) -> Any:
    from radixserve import LLM

    llm = LLM(model=model, dtype="float32", device=device, num_threads=1,
              max_running_requests=max_reqs, kv_cache_tokens=max_reqs * 512,
              max_prefill_tokens=max_reqs * PROMPT_LEN, chunked_prefill_size=0)
    return llm.engine


def _submit(engine: Any, n: int, max_tokens: int, tag: str) -> list[str]:
    import torch

    from radixserve.ipc.messages import GenerateMsg
    from radixserve.types import SamplingParams

    g = torch.Generator().manual_seed(n)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(n)]
    for rid in rids:
        ids = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g).tolist()
        engine.add_request(GenerateMsg(rid, ids, params))
    return rids


def _drain(engine: Any, rids: list[str]) -> None:
    for rid in rids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()


class ForwardTimer:
    """Wraps the model's forward to add up its seconds, wall and CPU (the part of a step that
    is not host work on CPU; on CUDA it is the launch time)."""

    def __init__(self, model: Any) -> None:
        self.wall = self.cpu = 0.0
        self._forward = model.forward
        model.forward = self._timed

    def _timed(self, *args: Any, **kwargs: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        out = self._forward(*args, **kwargs)
        self.wall += time.perf_counter() - t
        self.cpu += time.process_time() - c
        return out


def decode_step_ms(engine: Any, fwd: ForwardTimer, batch: int, steps: int) -> list[float]:
    """Per decode step at `batch` running requests, in ms: [wall, of which in the forward,
    CPU time, of which in the forward]. CPU time (one torch thread) is what the step costs
    whatever else the machine runs; wall time is what a client sees."""
    rids = _submit(engine, batch, steps + 8, f"d{batch}")
    for _ in range(4):  # prefill (one step), then warm decode steps
        engine.step()
    fwd.wall = fwd.cpu = 0.0
    t, c = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    _drain(engine, rids)
    return [1000 * x / steps for x in (wall, fwd.wall, cpu, fwd.cpu)]


def admission_ms(engine: Any, n: int) -> float:
    """CPU ms of the scheduling call that admits n queued requests at once."""
    sched = engine.scheduler
    inner = sched.schedule
    calls: list[float] = []

    def timed() -> Any:
        t = time.process_time()
        out = inner()
        calls.append(time.process_time() - t)
        return out

    sched.schedule = timed
    rids = _submit(engine, n, 4, f"a{n}")
    engine.step()
    del sched.schedule  # back to the class's method
    _drain(engine, rids)
    return 1000 * calls[0]


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import radixserve

    batches = [int(b) for b in args.batches.split(",")]
    admits = [int(n) for n in args.admit.split(",")]
    engine = _engine(args.model, args.device, max(batches + admits))
    fwd = ForwardTimer(engine.runner.model)
    decode_step_ms(engine, fwd, max(batches), 4)  # warm-up: allocator, kernels, caches
    step = {b: decode_step_ms(engine, fwd, b, args.steps) for b in batches}
    admission_ms(engine, max(admits))  # warm-up
    admit = {n: admission_ms(engine, n) for n in admits}
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"source": str(Path(radixserve.__file__).parent.parent),
            "step": {str(b): v for b, v in step.items()},
            "admit": {str(n): v for n, v in admit.items()}}


def spawn(args: argparse.Namespace, source: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(source))
    # -P: bench/ off sys.path, else bench/kernels.py shadows the `kernels` package that
    # transformers imports.
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", "--model", args.model,
           "--device", args.device, "--batches", args.batches, "--admit", args.admit,
           "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=source)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _median(runs: list[dict[str, Any]], key: str, item: str, i: int | None = None) -> float:
    return float(statistics.median(r[key][item] if i is None else r[key][item][i] for r in runs))


def report(label: str, runs: list[dict[str, Any]]) -> list[str]:
    batches = list(runs[0]["step"])
    # [wall, wall in forward, cpu, cpu in forward] per batch size, medians over rounds
    t = {b: [_median(runs, "step", b, i) for i in range(4)] for b in batches}
    lines = [f"{label}: {runs[0]['source']}"]
    for b in batches:
        w, wf, c, cf = t[b]
        lines.append(f"  batch {b:>4}: wall {w:7.2f} ms/step (forward {wf:6.2f}, host "
                     f"{w - wf:6.2f}); cpu {c:7.2f} ms/step (forward {cf:6.2f}, host "
                     f"{c - cf:6.2f})")
    for a, b in zip(batches, batches[1:], strict=False):
        n = int(b) - int(a)
        growth = [1000 * (t[b][i] - t[a][i]) / n for i in range(4)]
        lines.append(f"  growth {a}->{b}, us per request per step: wall {growth[0]:5.1f} "
                     f"(host {growth[0] - growth[1]:5.1f}); cpu {growth[2]:5.1f} "
                     f"(host {growth[2] - growth[3]:5.1f})")
    admits = list(runs[0]["admit"])
    admit = {n: _median(runs, "admit", n) for n in admits}
    cells = ", ".join(f"{n}: {admit[n]:.1f} ms" for n in admits)
    ratio = admit[admits[-1]] / admit[admits[0]]
    lines.append(f"  admission at once (cpu): {cells}; ratio {ratio:.1f}x for "
                 f"{int(admits[-1]) / int(admits[0]):.0f}x the requests")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--admit", default="256,1024")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", help="another source tree (containing radixserve/)")
    ap.add_argument("--simulated-device-ms", type=float, default=None,
                    help="replace the forward by a wait of this many ms on a simulated "
                         "asynchronous device: step time with and without overlap")
    ap.add_argument("--model", default="", help=argparse.SUPPRESS)  # the worker's: built here
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        # Run as a script (so that PYTHONPATH picks the source tree), bench/ itself is on the
        # path first, where bench/kernels.py would shadow the `kernels` package.
        here = Path(__file__).resolve().parent
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
        print(json.dumps(worker(args)))
        return
    if args.simulated_device_ms is not None:
        from bench.simulated_device import report as simulated

        with tempfile.TemporaryDirectory() as tmp:
            model = str(build_model(Path(tmp)))
            batches = [int(b) for b in args.batches.split(",")]
            print("\n".join(simulated(model, batches, args.steps, args.simulated_device_ms,
                                       args.rounds)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.model = str(build_model(Path(tmp)))
        sources = [("this", HERE)] + ([("baseline", Path(args.baseline))] if args.baseline
                                      else [])
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in sources}
        for i in range(args.rounds):
            for name, src in (sources if i % 2 == 0 else sources[::-1]):
                runs[name].append(spawn(args, src))
    print(f"host work per step: tiny Llama (2 layers, hidden 64, vocab {VOCAB}), float32, "
          f"{args.device}, 1 torch thread, {args.steps} decode steps, median of "
          f"{args.rounds} alternating rounds")
    for name, rs in runs.items():
        print("\n".join(report(name, rs)))


if __name__ == "__main__":
    main()
