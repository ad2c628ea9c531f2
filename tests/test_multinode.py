"""Acceptance 3 of the ZeRO core: two "nodes" on this machine (num_nodes=2, devices=1) train
together, launched the two ways clusters do: Lightning's own environment variables
(NODE_RANK / MASTER_ADDR / MASTER_PORT, as a SLURM script or a user sets them) and torchrun
(TorchElastic). Both must match the single-process reference."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _scripts import SCRIPTS, free_port, max_rel_diff, run_json, script_env

CONFIG = "3:1:norm=0.5"
STEPS = "10"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "ref.json"
    return run_json("parity.py", out, "--configs", "0:1:norm=0.5", "--reference", "--devices", "1", "--steps", STEPS)["0:1:norm=0.5"]


def _launch_two_nodes(commands: list[list[str]], envs: list[dict[str, str]], timeout: float = 300) -> None:
    procs = [subprocess.Popen(c, env=script_env(e), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c, e in zip(commands, envs)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, o in zip(procs, outputs):
        assert p.returncode == 0, o[-5000:]


def test_two_nodes_lightning_environment(tmp_path, reference):
    port = str(free_port())
    out = tmp_path / "nodes.json"
    args = [sys.executable, str(SCRIPTS / "parity.py"), "--configs", CONFIG, "--devices", "1", "--num-nodes", "2",
            "--steps", STEPS, "--out", str(out)]
    envs = [{"NODE_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in (0, 1)]
    _launch_two_nodes([args, args], envs)
    got = json.loads(out.read_text())[CONFIG]
    assert max_rel_diff(got, reference) < 1e-5


def test_two_nodes_torchrun(tmp_path, reference):
    port = str(free_port())
    out = tmp_path / "nodes.json"
    cmds = [[sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={r}", "--nproc_per_node=1",
             "--master_addr=127.0.0.1", f"--master_port={port}", str(SCRIPTS / "parity.py"), "--configs", CONFIG,
             "--devices", "1", "--num-nodes", "2", "--steps", STEPS, "--out", str(out)] for r in (0, 1)]
    _launch_two_nodes(cmds, [{}, {}])
    got = json.loads(out.read_text())[CONFIG]
    assert max_rel_diff(got, reference) < 1e-5
