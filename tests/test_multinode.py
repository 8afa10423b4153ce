"""Two "nodes" of one process each, on this machine over loopback and launched as ``docs/scaling.md``
says (``torchrun`` on each node, ``--trainer.num_nodes 2 --trainer.devices 1``), train exactly as one
node of two processes: the same losses and parameters under both one-loop-override strategies, and
each rank's loop counts follow its global rank (both processes are local rank 0 of their node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import _dist_worker
from test_strategies import _free_port, corpus, wait_for  # noqa: F401 (fixture)

WORKER = Path(_dist_worker.__file__)
WORLD = 2
#: One case per strategy, run one after the other by the same processes.
CASES = {name: {"strategy": name, "virtual_ranks": 2, "batch_size": 2} for name in ("ddp", "fsdp")}
#: Each rank's watchdog (faulthandler) and the test's limit on a launch; collectives time out at 30 s.
WATCHDOG_S = 150
LAUNCH_TIMEOUT_S = 240
#: What a launcher (torchrun, SLURM) may have set in the test's own environment.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun(spec: Path, nnodes: int, nproc: int, node_rank: int, port: int, log: Any) -> subprocess.Popen:
    """``torchrun`` for one node, as a user starts it on each machine (its own session, so it can be killed whole)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc),
        "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
        str(WORKER), str(spec),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_nodes(corpus: dict[str, str], out: Path, nnodes: int) -> dict[str, list[dict[str, Any]]]:  # noqa: F811
    """Train every case on ``nnodes`` node(s) of ``WORLD // nnodes`` processes; each case's per-rank results."""
    out.mkdir()
    cases = [{"name": name, **case} for name, case in CASES.items()]
    spec = {**corpus, "steps": 4, "out": str(out), "watchdog_s": WATCHDOG_S, "cases": cases}
    (out / "spec.json").write_text(json.dumps(spec))
    port = _free_port()
    logs = [open(out / f"node{n}.log", "w") for n in range(nnodes)]
    agents = [torchrun(out / "spec.json", nnodes, WORLD // nnodes, n, port, logs[n]) for n in range(nnodes)]
    wait_for(agents, logs, LAUNCH_TIMEOUT_S, f"{nnodes} node(s)")  # kills an agent with the ranks it started
    return {name: [torch.load(out / f"{name}.rank{r}.pt", weights_only=True) for r in range(WORLD)] for name in CASES}


@pytest.mark.slow
def test_two_nodes_train_as_one_node_of_two_processes(corpus, tmp_path: Path) -> None:  # noqa: F811
    two_nodes = run_nodes(corpus, tmp_path / "two_nodes", nnodes=2)
    one_node = run_nodes(corpus, tmp_path / "one_node", nnodes=1)
    for name in CASES:
        for rank, (got, want) in enumerate(zip(two_nodes[name], one_node[name], strict=True)):
            assert got["placement"] == {
                "global_rank": rank, "node_rank": rank, "local_rank": 0, "num_nodes": 2, "data_parallel_rank": rank
            }  # fmt: skip
            assert want["placement"] == {
                "global_rank": rank, "node_rank": 0, "local_rank": rank, "num_nodes": 1, "data_parallel_rank": rank
            }  # fmt: skip
            print(f"{name} rank {rank}: loops {got['loops']}; losses two nodes {got['losses']}, one node {want['losses']}")
            assert got["losses"] == want["losses"], f"{name} rank {rank}"
            assert got["loops"] == want["loops"], f"{name} rank {rank}"
            for key, value in want["state"].items():
                assert torch.equal(got["state"][key], value), f"{name} rank {rank}: {key}"
        # both processes are local rank 0: their loop counts differ because they follow the global rank
        steps = zip(two_nodes[name][0]["loops"], two_nodes[name][1]["loops"], strict=True)
        assert any(first[1] != second[1] for first, second in steps), f"{name}: the ranks never ran different k"
        state, initial = two_nodes[name][0]["state"], two_nodes[name][0]["initial"]
        moved = max((state[k].float() - initial[k].float()).abs().max().item() for k in initial)
        assert moved > 1e-2, f"{name}: training barely moved the parameters; the comparison proves nothing"
