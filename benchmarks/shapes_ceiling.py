"""Read back the runs of ``benchmarks/shapes_ceiling.sh``: held-out strict accuracy per rollout, overall
and per prompt family, for every run folder under a directory, into one JSON file.

    python benchmarks/shapes_ceiling.py summarize OUT/work --json OUT/summary.json

Each run folder is one ``shapes_runs.py run`` job (``LABEL__sSEED/`` with its ``metrics.csv``); the
family split is ``HeldOutReport``'s ``val-aux/shapes/strict/<family>/mean@1``, logged at every
evaluation. Per label it prints the mean over seeds at each evaluation all seeds reached, and the
seeds' range of the gain at the last one. Base-model scores written by ``python -m
lit_flowgrpo.toy.evaluate --json`` (``*.eval.json``) are copied into the summary as they are.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes_runs import read_run  # the benchmarks folder is not a package

FAMILY_PREFIX = "val-aux/shapes/strict/"


def families(folder: Path) -> dict[int, dict[str, float]]:
    """{rollouts done: {family: strict accuracy}} of one run (0: the base model), as ``read_run`` counts."""
    files = sorted(folder.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    out: dict[int, dict[str, float]] = {}
    for row in csv.DictReader(files[-1].read_text().splitlines()) if files else []:
        at = int(float(row["step"])) + 1 if row.get("epoch") else 0
        for key, value in row.items():
            if key.startswith(FAMILY_PREFIX) and key.endswith("/mean@1") and value:
                out.setdefault(at, {})[key[len(FAMILY_PREFIX) : -len("/mean@1")]] = float(value)
    return out


def summarize(root: Path) -> dict:
    runs = []
    for run_json in sorted(root.rglob("run.json")):
        folder = run_json.parent
        run = read_run(folder)
        run["families"] = families(folder)
        run["group"] = folder.parent.name
        times = [t for k, t in sorted(run["s_per_rollout"].items()) if k > 1]
        run["median_s_per_step_shared"] = statistics.median(times) if times else None
        run["config"] = json.loads(run_json.read_text())
        runs.append(run)
    labels: dict[str, dict] = {}
    for key in dict.fromkeys(f"{r['group']}/{r['label']}" for r in runs):
        group = [r for r in runs if f"{r['group']}/{r['label']}" == key]
        common = sorted(set.intersection(*(set(r["held_out"]) for r in group)))
        entry = {
            "seeds": [r["seed"] for r in group],
            "rollouts_reached": {r["seed"]: max(r["held_out"], default=None) for r in group},
            "held_out_mean": {k: statistics.mean(r["held_out"][k] for r in group) for k in common},
            "paired": {r["seed"]: r["paired"] for r in group},
        }
        fam_common = sorted(set.intersection(*(set(r["families"]) for r in group)))
        entry["families_mean"] = {
            k: {f: statistics.mean(r["families"][k][f] for r in group) for f in group[0]["families"][k]}
            for k in fam_common
        }
        if len(common) >= 2:
            gains = [r["held_out"][common[-1]] - r["held_out"][common[0]] for r in group]
            entry.update(last_common=common[-1], gain_mean=statistics.mean(gains), gains=gains)
        labels[key] = entry
        line = "  ".join(f"{k}:{v:.3f}" for k, v in entry["held_out_mean"].items())
        print(f"{key} (seeds {entry['seeds']}): {line}")
        if "gains" in entry:
            print(f"    gain at {entry['last_common']}: {entry['gain_mean']:+.3f} "
                  f"[{min(entry['gains']):+.3f}, {max(entry['gains']):+.3f}]")  # fmt: skip
    bases = {p.name: json.loads(p.read_text()) for p in sorted(root.rglob("*.eval.json"))}
    for name, result in bases.items():
        for r in result:
            fam = {t: round(v["strict"], 3) for t, v in r["by_family"].items()}
            print(f"base {name} guidance {r['guidance']}: strict {r['strict']:.3f} {fam}")
    return {"labels": labels, "runs": runs, "bases": bases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize", help="every run under a folder, into one JSON")
    s.add_argument("root", type=Path)
    s.add_argument("--json", type=Path, required=True)
    opts = parser.parse_args()
    summary = summarize(opts.root)
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {opts.json}")


if __name__ == "__main__":
    main()
