"""Models nobody on this project wrote train under every ZeRO stage exactly as in one process.

For each architecture of tests/conformance/zoo.py, tests/conformance/train.py fits a plain
``Trainer(devices=2, strategy=...)`` at stages 0, 1, 2 and 3 by their registered names, and at
stages 2 and 3 with a ``reduce_bucket_size`` of an eighth of the model (several units; stage 3
with every unit resharded), and at stage 3 with ``activation_checkpointing="full"`` (every
block recomputed in backward: T5's decoder cache and ResNet's BatchNorm statistics broke it
before, [Notes: a cache inside a checkpointed block, buffers a recomputation updates] in
lightning_ampzero/activation/apply.py), 10 steps each, and checks against the one-process reference:

* parameters and buffers after setup bit-for-bit equal to the one-process model built from the
  same seed (whatever init code the model runs), and metric states untouched by setup;
* per-step losses within 1e-5 relative;
* metric values (torchmetrics, synced over the ranks) equal;
* buffers after training (BatchNorm running statistics) equal to DDP's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scripts import run_script  # noqa: E402
from zoo import FAST, ZOO  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("peft")

CONFIGS = "0,1,2,2s,3,3s,3a"
SCRIPT = Path(__file__).resolve().parent / "train.py"


def _failures(result: dict) -> list[str]:
    ref = result["reference"]
    problems = []
    for config in CONFIGS.split(","):
        got = result[config]
        if got["init_mismatch"]:
            problems.append(f"stage {config}: initial values differ from one process for {got['init_mismatch'][:5]}"
                            f" ({len(got['init_mismatch'])} tensors)")
        if not got["metric_states_clean"]:
            problems.append(f"stage {config}: setup changed the metrics' states")
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got["losses"], ref["losses"]))
        if len(got["losses"]) != len(ref["losses"]) or rel > 1e-5:
            problems.append(f"stage {config}: losses differ (max relative {rel:.2e}): {got['losses'][:4]} vs"
                            f" {ref['losses'][:4]}")
        for key, value in ref["metrics"].items():
            if abs(got["metrics"][key] - value) > 1e-6 * max(1.0, abs(value)):
                problems.append(f"stage {config}: metric {key} {got['metrics'][key]} vs {value}")
        if got["buffer_max_diff"] > 1e-5:
            problems.append(f"stage {config}: buffers after training differ by {got['buffer_max_diff']:.2e}")
    return problems


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in ZOO])
def test_model_trains_like_one_process_at_every_stage(name: str, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run_script(str(SCRIPT), "--model", name, "--configs", CONFIGS, "--out", str(out), timeout=540,
               env={"OMP_NUM_THREADS": "1"})
    problems = _failures(json.loads(out.read_text()))
    assert not problems, f"{name}:\n" + "\n".join(problems)
