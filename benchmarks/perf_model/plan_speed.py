"""Wall time of `ptdp plan` for GPT-3 175B with a 1536 batch at several GPU counts.

Each count runs `python -m ptdp plan --model gpt3-175b --gpus N --global-batch 1536 --json`
in a fresh process and records its wall and CPU time (user + system: on a shared, loaded
machine the wall time mostly measures the load) and the recommended layout. With
`--baseline DIR` (another ptdp tree, e.g. `git archive <commit> | tar -x -C /tmp/old`) the
same command runs from that tree too, alternating with this one at each count, so that both
see the same load on a shared machine.

    python benchmarks/perf_model/plan_speed.py [--gpus 384 1024 3072] [--baseline DIR]

The rows go to runs/benchmarks/plan_speed.json (ignored by git) and a markdown table is
printed for BENCHMARKS.md; no tracked file is written.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def time_plan(tree: Path, gpus: int, batch: int, device: str) -> dict:
    """One `ptdp plan` from `tree`: wall and CPU seconds, the recommended layout."""
    args = ["plan", "--model", "gpt3-175b", "--gpus", str(gpus), "--global-batch", str(batch)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "ptdp", *args, "--device", device, "--json"]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} failed in {tree}:\n{done.stderr[-2000:]}")
    out = json.loads(done.stdout)
    best = out["best"]
    return {
        "tree": str(tree),
        "gpus": gpus,
        "seconds": seconds,
        "cpu_seconds": cpu,
        "listed": len(out["options"]),
        "recommended": best["summary"] if best else None,
        "iteration_seconds": best["iteration_seconds"] if best else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[384, 1024, 3072])
    parser.add_argument("--batch", type=int, default=1536)
    parser.add_argument("--device", default="a100-80gb")
    parser.add_argument("--baseline", type=Path, help="another ptdp checkout to time alike")
    parser.add_argument("--out", type=Path, default=ROOT / "runs/benchmarks/plan_speed.json")
    args = parser.parse_args()
    trees = [ROOT] + ([args.baseline.resolve()] if args.baseline else [])
    rows = []
    for gpus in args.gpus:
        for tree in reversed(trees):  # the baseline first, then this tree, at each count
            row = time_plan(tree, gpus, args.batch, args.device)
            what = f"{row['seconds']:.1f} s wall, {row['cpu_seconds']:.1f} s CPU"
            print(f"{tree}: {gpus} GPUs: {what}", file=sys.stderr, flush=True)
            rows.append(row)
    loads = os.getloadavg()
    record = {"load_average": loads, "cpus": os.cpu_count(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"| GPUs | {' | '.join(str(t) for t in trees)} | recommended |")
    print(f"|---|{'---|' * len(trees)}---|")
    for gpus in args.gpus:
        mine = [r for r in rows if r["gpus"] == gpus]
        cells = [
            f"{r['seconds']:.1f} s ({r['cpu_seconds']:.1f} s CPU)"
            for t in trees
            for r in mine
            if r["tree"] == str(t)
        ]
        print(f"| {gpus} | {' | '.join(cells)} | {mine[0]['recommended']} |")
    print(f"(load average at the end {loads[0]:.1f} on {os.cpu_count()} CPUs; {args.out})")


if __name__ == "__main__":
    main()
