#!/usr/bin/env python3
"""Whole training steps of two or more comera builds at 1 and 2 threads, side by side.

    tools/scaling/ab_step.py BATCH ROUNDS STEPS BINARY [BINARY ...]

e.g. `tools/scaling/ab_step.py 32 6 3 /tmp/comera-before target/release/comera`. Each round
runs every binary (starting with a different one each round) at 1 and 2 threads (the order
alternating between rounds) as

    BINARY --threads T bench step --models tt --batch BATCH --steps STEPS --rounds 1 --json

and keeps each run's `median_ms`. It prints, per binary, the minimum and the median over the
rounds at each thread count, the speed-up by the minima and by the medians, and every
2-thread run. Interleaving is what makes builds comparable on a machine whose speed drifts
(docs/scaling.md); check the load first (`uptime`) and keep other work off the machine.
"""
import json
import statistics
import subprocess
import sys


def step_ms(binary, threads, batch, steps):
    out = subprocess.run(
        [binary, "--threads", str(threads), "bench", "step", "--models", "tt", "--batch",
         str(batch), "--steps", str(steps), "--rounds", "1", "--json"],
        capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "median_ms" in row:
            return float(row["median_ms"])
    raise SystemExit(f"{binary}: no median_ms in its output:\n{out}")


def main():
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    batch, rounds, steps = (int(a) for a in sys.argv[1:4])
    binaries = sys.argv[4:]
    times = {}
    for r in range(rounds):
        for i in range(len(binaries)):
            b = binaries[(i + r) % len(binaries)]
            for t in (1, 2) if r % 2 == 0 else (2, 1):
                times.setdefault((b, t), []).append(step_ms(b, t, batch, steps))
    for b in binaries:
        one, two = times[(b, 1)], times[(b, 2)]
        print(f"{b}: 1 thread min {min(one):.2f} med {statistics.median(one):.2f} | "
              f"2 threads min {min(two):.2f} med {statistics.median(two):.2f} | "
              f"speed-up {min(one) / min(two):.2f} (minima) "
              f"{statistics.median(one) / statistics.median(two):.2f} (medians) | "
              f"2-thread runs {sorted(round(x, 1) for x in two)}")


if __name__ == "__main__":
    main()
