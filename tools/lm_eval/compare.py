"""The same lm-evaluation-harness task run against `kvscope serve` (local-completions) and lm-eval's
own `hf` backend: `python tools/lm_eval/compare.py KVSCOPE_DIR HF_DIR` reads each run's
samples_*.jsonl (written with --log_samples) and prints both accuracies and the largest difference
between their per-choice log-likelihoods (the goal: the same accuracy, within 1e-4)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def samples(folder: Path) -> dict[int, list[float]]:
    (path,) = sorted(folder.rglob("samples_*.jsonl"))[-1:]
    out = {}
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        out[sample["doc_id"]] = [float(r[0][0]) for r in sample["resps"]]
    return out


def accuracy(folder: Path) -> dict[str, float]:
    (path,) = sorted(folder.rglob("results_*.json"))[-1:]
    results = json.loads(path.read_text())["results"]
    (task,) = results.values()
    return {k.split(",")[0]: v for k, v in task.items() if k.split(",")[0] in ("acc", "acc_norm")}


def main(argv: list[str]) -> int:
    served, reference = Path(argv[0]), Path(argv[1])
    a, b = samples(served), samples(reference)
    assert a.keys() == b.keys(), "the two runs scored different documents"
    gaps = [abs(x - y) for doc in a for x, y in zip(a[doc], b[doc], strict=True)]
    print(
        json.dumps(
            {
                "documents": len(a),
                "choices": len(gaps),
                "kvscope_serve": accuracy(served),
                "hf": accuracy(reference),
                "max_abs_loglikelihood_gap": max(gaps),
                "mean_abs_loglikelihood_gap": sum(gaps) / len(gaps),
                "within_1e-4": max(gaps) <= 1e-4,
            },
            indent=2,
        )
    )
    return 0 if max(gaps) <= 1e-4 and accuracy(served) == accuracy(reference) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
