"""Issue 15: ``ampzero-estimate`` gives the bytes NVMe offload moves per step, and the planner
considers NVMe when nothing else fits, on a CPU-only machine too (``--accelerator cpu``).

The model of benchmarks/bench_infinity.py (GPT 32 x 2560, 2.52B parameters, 40 GB of fp32 model
states) on its 24 GiB, 2-rank machine: the planner must choose stage 3 with parameters and
optimizer on NVMe, its host figure must be the one the benchmark reports beside the RSS it
measured (results/infinity_cpu.md: 6.86 GiB of model states per rank), and its I/O seconds the
benchmark's I/O lower bound (30.1 s with the drive bandwidths measured in that run).
The benchmark's figures were measured with gradient shards in host memory (``offload_grad="none"``;
``auto``, the default now, swaps them too with parameters on NVMe), so its settings say so.
No training here: models are built on the meta device."""

from __future__ import annotations

import json

import pytest

from lightning_ampzero.cli.estimate import main
from lightning_ampzero.config import OffloadConfig, ZeroConfig
from lightning_ampzero.estimate import (
    GiB,
    ModelSize,
    estimate,
    format_bytes,
    gpt_activations,
    gpt_size,
    host_on_cpu,
    nvme_traffic,
    plan,
)
from lightning_ampzero.models.config import GPTConfig

PSI, L, N = 1_000_000, 100_000, 4
SIZE = ModelSize(PSI, L)
NO_PREFETCH = ZeroConfig(prefetch_bucket_size=0)

# benchmarks/bench_infinity.py's defaults: one transformer block per FSDP2 unit, its offload buffers
UNIT = 12 * 2560**2 + 13 * 2560
BENCH_ZERO = ZeroConfig(stage=3, reduce_bucket_size=UNIT, allgather_bucket_size=UNIT, prefetch_bucket_size=UNIT)
BENCH_BUFFERS = OffloadConfig(offload_optimizer="nvme", offload_param="nvme", sub_group_size=2.5e7, buffer_count=6,
                              param_buffer_count=5, param_buffer_size=1e8, offload_grad="none")
BENCH_CFG = GPTConfig(vocab_size=256, block_size=64, n_layer=32, n_head=20, n_embd=2560)
BENCH_ARGS = ["--model", "gpt", "--n-layer", "32", "--n-embd", "2560", "--n-head", "20", "--block-size", "64",
              "--precision", "32-true", "--accelerator", "cpu", "--gpus-per-node", "2",
              *[f"--zero={k}_bucket_size={UNIT}" for k in ("reduce", "allgather", "prefetch")],
              "--offload-config", "sub_group_size=2.5e7", "--offload-config", "offload_grad=none"]


@pytest.fixture(scope="module")
def bench():
    return gpt_size(BENCH_CFG, BENCH_ZERO), gpt_activations(BENCH_CFG, 1, 64, "32-true")


def _bench_plan(bench, cpu_memory, buffers=BENCH_BUFFERS, **kw):
    size, acts = bench
    return plan(size, None, cpu_memory, accelerator="cpu", nvme_memory=200 * 10**9, activations=acts,
                cpu_headroom=0.1, gpus_per_node=2, precision="32-true", zero=BENCH_ZERO, buffers=buffers, **kw)


# ---------------------------------------------------------------------------------------
# Bytes per step in the CLI = nvme_traffic's
# ---------------------------------------------------------------------------------------


COUNTS = ["--params", "1e6", "--largest-layer", "1e5", "--gpus-per-node", "4"]


def test_cli_json_gives_nvme_bytes_per_rank_and_node(capsys):
    assert main(COUNTS + ["--nodes", "2", "--offload-config", "offload_grad=none", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "nvme_traffic" in data and "per optimizer step" in data["nvme_traffic"]
    seen = set()
    for row in data["model_states"]:
        read, written = nvme_traffic(SIZE, row["offload"], 8, ZeroConfig())
        assert (row["nvme_read"], row["nvme_written"]) == (read, written)
        assert (row["nvme_read_node"], row["nvme_written_node"]) == (4 * read, 4 * written)
        seen.add((row["offload"], read > 0))
    # NVMe options move bytes, the others none
    assert ("params+optimizer=nvme", True) in seen and ("optimizer=nvme", True) in seen
    assert ("optimizer=cpu", False) in seen and ("none", False) in seen
    # by default the CLI sizes the run as OffloadConfig's defaults do (gradients swapped too: "auto")
    assert main(COUNTS + ["--nodes", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["model_states"]
    buffers = OffloadConfig(offload_optimizer="nvme", offload_param="nvme")
    for row in rows:
        e = estimate(SIZE, row["stage"], row["offload"], gpus_per_node=4, nodes=2, buffers=buffers)
        assert (row["nvme_read_node"], row["nvme_written_node"], row["cpu"]) == (4 * e.nvme_read, 4 * e.nvme_written,
                                                                                 e.cpu)


def test_cli_table_prints_nvme_bytes_with_a_caption(capsys):
    assert main(COUNTS + ["--offload-config", "offload_grad=none"]) == 0
    out = capsys.readouterr().out
    assert "NVMe swap files, bytes per optimizer step" in out
    assert "read and written once" in " ".join(out.split())  # the caption says what is counted
    for offload in ("optimizer=nvme", "params+optimizer=nvme"):
        read, written = nvme_traffic(SIZE, offload, N, ZeroConfig())
        section = out[out.index("NVMe swap files"):].splitlines()
        row = next(line for line in section if f" {offload} " in line)
        cells = [c.strip() for c in row.strip("│ ").split("│")]
        assert cells[3:] == [format_bytes(read), format_bytes(written), format_bytes(4 * read),
                             format_bytes(4 * written)]


# ---------------------------------------------------------------------------------------
# The planner on a CPU-only machine
# ---------------------------------------------------------------------------------------


def test_host_on_cpu_counts_the_gradient_shard_once():
    # fp32 AdamW, N = 4, one-unit prefetch: stage 3 optimizer=nvme keeps (4 + 4)Ψ/N + 12L "on the
    # device" and 4Ψ/N (the gradient shard) on the host: the same tensor without a GPU
    e = estimate(SIZE, 3, "optimizer=nvme", gpus_per_node=N, zero=NO_PREFETCH, accelerator="cpu")
    assert (e.gpu_grads, e.cpu) == (4 * PSI // N, 0)  # the shard is the rank's .grad, not a host copy
    assert host_on_cpu(e, gpus_per_node=N) == (8 * PSI // N + 12 * L, N * (8 * PSI // N + 12 * L))
    e = estimate(SIZE, 3, "params+optimizer=nvme", gpus_per_node=N, zero=NO_PREFETCH, accelerator="cpu")
    assert host_on_cpu(e, gpus_per_node=N, activations=5) == (4 * PSI // N + 12 * L + 5,
                                                                     N * (4 * PSI // N + 12 * L + 5))
    e = estimate(SIZE, 3, "none", gpus_per_node=N, zero=NO_PREFETCH, accelerator="cpu")
    assert host_on_cpu(e, gpus_per_node=N)[0] == 16 * PSI // N + 12 * L
    # optimizer=cpu: master + moments on the host (12Ψ/N), the gradient once, in the rank's grads
    e = estimate(SIZE, 3, "optimizer=cpu", gpus_per_node=N, zero=NO_PREFETCH, accelerator="cpu")
    assert (e.gpu_grads, e.cpu) == (4 * PSI // N, N * 12 * PSI // N)
    # params+optimizer=cpu swaps the shards to tmpfs: their file (4Ψ/N) is host memory
    e = estimate(SIZE, 3, "params+optimizer=cpu", gpus_per_node=N, zero=NO_PREFETCH, accelerator="cpu")
    assert (e.gpu_params, e.gpu_grads, e.cpu) == (0, 4 * PSI // N, N * 16 * PSI // N)
    with pytest.raises(ValueError, match="accelerator='cpu'"):
        host_on_cpu(estimate(SIZE, 3, "none", gpus_per_node=N, zero=NO_PREFETCH), gpus_per_node=N)


def test_plan_on_24GiB_cpu_machine_picks_infinity(bench):
    size, acts = bench
    p = _bench_plan(bench, 24 * GiB)
    c = p.choice
    assert (c.stage, c.offload, c.checkpointing) == (3, "params+optimizer=nvme", "none")
    assert p.gpu_budget is None and p.accelerator == "cpu"
    # every faster candidate was rejected for host memory, the node's total over the budget
    assert p.rejected and all(r.cpu > p.cpu_budget and any(x.startswith("host needs") for x in r.reasons)
                              for r in p.rejected)
    assert {r.offload for r in p.rejected} >= {"none", "optimizer=cpu", "optimizer=nvme", "params+optimizer=cpu"}
    # the host figure is the benchmark's (bench_infinity.py: gpu + cpu / ranks - gpu_grads), plus activations
    est = estimate(size, 3, "params+optimizer=nvme", gpus_per_node=2, zero=BENCH_ZERO, buffers=BENCH_BUFFERS)
    bench_host = est.gpu + est.cpu // 2 - est.gpu_grads
    assert c.host_per_rank == bench_host + acts.bytes("none") and c.cpu == 2 * c.host_per_rank
    assert abs(bench_host / GiB - 6.86) < 0.005  # results/infinity_cpu.md
    # its NVMe bytes are nvme_traffic's, the benchmark's measured 25.19 / 20.15 GB per rank
    assert (c.nvme_read, c.nvme_written) == nvme_traffic(size, "params+optimizer=nvme", 2, BENCH_ZERO)
    assert (round(c.nvme_read / 1e9, 2), round(c.nvme_written / 1e9, 2)) == (25.19, 20.15)
    assert (c.nvme_read_node, c.nvme_written_node) == (2 * c.nvme_read, 2 * c.nvme_written)
    # without NVMe nothing fits; with 200 GiB of RAM no NVMe option is needed
    assert _bench_plan(bench, 24 * GiB, offloads=("none", "optimizer=cpu", "params+optimizer=cpu")).choice is None
    big = _bench_plan(bench, 200 * GiB).choice
    assert big.nvme == 0 and big.offload == "none" and (big.nvme_read, big.nvme_written) == (0, 0)
    # OffloadConfig's defaults (larger optimizer tiles; gradient shards swapped as well): the same choice
    default = _bench_plan(bench, 24 * GiB, buffers=OffloadConfig(offload_optimizer="nvme", offload_param="nvme"))
    assert (default.choice.stage, default.choice.offload) == (3, "params+optimizer=nvme")


def test_nvme_bandwidth_gives_io_seconds(bench):
    read_bw, write_bw = 2.58e9, 3.82e9  # the drive as bench_infinity.py measured it (cold read, rewrite)
    p = _bench_plan(bench, 24 * GiB, nvme_bandwidth=(read_bw, write_bw))
    for c in p.candidates:
        if c.nvme:
            assert c.io_seconds == pytest.approx(c.nvme_read_node / read_bw + c.nvme_written_node / write_bw)
        else:
            assert c.io_seconds is None
    assert round(p.choice.io_seconds, 1) == 30.1  # the benchmark's "I/O lower bound per step"
    one = _bench_plan(bench, 24 * GiB, nvme_bandwidth=2e9).choice
    assert one.io_seconds == pytest.approx((one.nvme_read_node + one.nvme_written_node) / 2e9)
    assert _bench_plan(bench, 24 * GiB).choice.io_seconds is None
    with pytest.raises(ValueError, match="nvme_bandwidth must be bytes per second"):
        _bench_plan(bench, 24 * GiB, nvme_bandwidth=0)
    with pytest.raises(ValueError, match="gpu_memory does not apply with accelerator='cpu'"):
        plan(SIZE, 10**9, 10**9, accelerator="cpu")


def test_cli_plan_on_cpu_machine(capsys, bench):
    size, _ = bench
    argv = ["plan", *BENCH_ARGS, "--cpu-memory", "24GiB", "--nvme-memory", "200GB"]
    assert main(argv + ["--json", "--nvme-bandwidth", "2.58GB/s", "--nvme-write-bandwidth", "3.82GB"]) == 0
    out = json.loads(capsys.readouterr().out)
    c = out["choice"]
    assert (c["stage"], c["offload"]) == (3, "params+optimizer=nvme") and out["accelerator"] == "cpu"
    assert (c["nvme_read"], c["nvme_written"]) == nvme_traffic(size, "params+optimizer=nvme", 2, BENCH_ZERO)
    assert out["nvme_bandwidth"] == [2.58e9, 3.82e9]
    assert c["io_seconds"] == pytest.approx(c["nvme_read_node"] / 2.58e9 + c["nvme_written_node"] / 3.82e9)
    rejected = [x for x in out["candidates"] if not x["fits"]]
    assert any(x["offload"] == "optimizer=nvme" and x["nvme_read"] > 0 for x in rejected)  # priced too
    assert main(argv + ["--nvme-bandwidth", "2.58GB", "--nvme-write-bandwidth", "3.82GB"]) == 0
    table = capsys.readouterr().out
    flat = " ".join(table.split())
    assert "I/O s / step" in table and "host / rank" in table and "GPU need" not in table
    assert f"{format_bytes(c['nvme_read'])} / {format_bytes(c['nvme_written'])}" in table
    assert f"at least {c['io_seconds']:,.1f} s per step of I/O alone" in flat
    assert 'AmpZeroStrategy(stage=3, offload_optimizer="nvme", offload_param="nvme")' in flat
    assert main(argv) == 0  # no bandwidth: the bytes, and how to get the seconds
    assert "Give --nvme-bandwidth" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, message", [
    (["plan", "--params", "1e6", "--largest-layer", "1e5", "--cpu-memory", "1TB"], "--gpu-memory is required"),
    (["plan", "--params", "1e6", "--largest-layer", "1e5", "--cpu-memory", "1TB", "--accelerator", "cpu",
      "--gpu-memory", "80GB"], "--gpu-memory does not apply with --accelerator cpu"),
    (["plan", "--params", "1e6", "--largest-layer", "1e5", "--cpu-memory", "1TB", "--gpu-memory", "80GB",
      "--nvme-write-bandwidth", "2GB"], "--nvme-write-bandwidth goes with --nvme-bandwidth"),
    (["plan", "--params", "1e6", "--largest-layer", "1e5", "--cpu-memory", "1TB", "--gpu-memory", "80GB",
      "--nvme-bandwidth", "0GB"], "must be > 0 bytes per second"),
    (["--params", "1e6", "--largest-layer", "1e5", "--offload-config", "sub_group=1"], "Did you mean"),
    (["--params", "1e6", "--largest-layer", "1e5", "--accelerator", "tpu"], "invalid choice: 'tpu'"),
])
def test_cli_rejects_bad_nvme_and_accelerator_options(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
