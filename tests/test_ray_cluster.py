"""The loop on a Ray cluster (several Ray nodes on this machine, fake GPUs): a node lost mid-run is the
executor's failure, so the experiment runs again on another node and no crash row is written."""

from __future__ import annotations

import threading
import time

import pytest

import fakes
from orchestrator.ledger import read_record, read_rows
from orchestrator.loop import Settings, run_loop
from orchestrator.session import Paths, read_status

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402


@pytest.fixture
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    nodes = [c.add_node(num_cpus=1, num_gpus=1) for _ in range(3)]  # two slots, one spare GPU node
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.mark.timeout(240)
def test_node_lost_mid_run_is_retried_not_recorded_as_a_crash(cluster, fake_repo, tmp_path, monkeypatch):
    c, nodes = cluster
    repo = fake_repo(fakes.ok(1.0))
    plan = fakes.write_plan(tmp_path / "plan.json", [{"description": "slow idea", "train": fakes.ok(0.9, 8.0)},
                                                     {"description": "other idea", "train": fakes.ok(0.95, 8.0)}])
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(plan))
    paths = Paths(repo, "r")
    lost = threading.Event()

    def lose_a_node() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (len(read_rows(paths.ledger)) >= 2 and len(
                (read_status(paths).get("running") or [])) == 2):
            time.sleep(0.2)
        time.sleep(2.0)  # the two ideas are now training (status lists both), on two of the three GPU nodes
        for node in nodes[:2]:  # at least one of them holds a running idea
            c.remove_node(node, allow_graceful=False)
        lost.set()

    threading.Thread(target=lose_a_node, daemon=True).start()
    lines: list[str] = []
    run_loop(Settings(repo=repo, tag="r", budget=10.0, timeout=60.0, proposer="fakes:Scripted",
                      baseline_repeats=0, executor="ray", workers=2, max_experiments=4), echo=lines.append)
    assert lost.is_set()
    rows = read_rows(paths.ledger)
    assert [r.status for r in rows] == ["keep", "discard", "discard", "discard"], "\n".join(lines)
    records = [read_record(paths.run_dir(n)) for n in (3, 4)]
    retried = [r for r in records if r.info.get("infra_failures")]
    assert retried and "NodeDied" in retried[0].info["infra_failures"][0]
    assert all(r.val_bpb in (0.9, 0.95) and r.device for r in records)
    assert any("the executor failed" in line and "running it again" in line for line in lines)
