"""The loop on a Ray cluster (several Ray nodes on this machine, fake GPUs): a node lost mid-run is the
executor's failure, so the experiment runs again on another node and no crash row is written; a run still
waiting for a GPU when its node goes comes back as the executor's failure at the schedule deadline, and the
slots shrink to the GPUs left."""

from __future__ import annotations

import threading
import time

import fakes
import pytest

from orchestrator import contract
from orchestrator.loop import Settings, run_loop
from orchestrator.store.ledger import read_record, read_rows
from orchestrator.store.session import Paths, read_status

pytestmark = pytest.mark.slow  # a local Ray cluster per test
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402


def gpu_cluster(gpu_nodes: int, **head_args):
    """A local Ray cluster: a CPU head and `gpu_nodes` one-GPU nodes, joined by this process; (cluster, nodes)."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, **head_args})
    nodes = [c.add_node(num_cpus=1, num_gpus=1) for _ in range(gpu_nodes)]
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def cluster():
    yield from gpu_cluster(3)  # two slots, one spare GPU node


@pytest.mark.timeout(240)
def test_node_lost_mid_run_is_retried_not_recorded_as_a_crash(cluster, fake_repo, tmp_path, monkeypatch):
    c, nodes = cluster
    repo = fake_repo(fakes.ok(1.0))
    plan = fakes.write_plan(
        tmp_path / "plan.json",
        [
            {"description": "slow idea", "train": fakes.ok(0.9, 8.0)},
            {"description": "other idea", "train": fakes.ok(0.95, 8.0)},
        ],
    )
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(plan))
    paths = Paths(repo, "r")
    lost = threading.Event()

    def lose_a_node() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            len(read_rows(paths.ledger)) >= 2 and len(read_status(paths).get("running") or []) == 2
        ):
            time.sleep(0.2)
        time.sleep(2.0)  # the two ideas are now training (status lists both), on two of the three GPU nodes
        for node in nodes[:2]:  # at least one of them holds a running idea
            c.remove_node(node, allow_graceful=False)
        lost.set()

    threading.Thread(target=lose_a_node, daemon=True).start()
    lines: list[str] = []
    run_loop(
        Settings(
            repo=repo,
            tag="r",
            budget=10.0,
            timeout=60.0,
            proposer="fakes:Scripted",
            baseline_repeats=0,
            executor="ray",
            workers=2,
            max_experiments=4,
        ),
        echo=lines.append,
    )
    assert lost.is_set()
    rows = read_rows(paths.ledger)
    assert [r.status for r in rows] == ["keep", "discard", "discard", "discard"], "\n".join(lines)
    records = [read_record(paths.run_dir(n)) for n in (3, 4)]
    retried = [r for r in records if r.info.get("infra_failures")]
    assert retried and "NodeDied" in retried[0].info["infra_failures"][0]
    assert all(r.val_bpb in (0.9, 0.95) and r.device for r in records)
    assert any("the executor failed" in line and "running it again" in line for line in lines)


@pytest.fixture
def two_gpu_nodes():
    # a lost node is noticed in seconds (health checks every second, 3 missed), not Ray's default 15 s
    fast = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
    yield from gpu_cluster(2, _system_config=fast)


@pytest.mark.timeout(90)
def test_a_run_pending_when_its_node_goes_is_an_infra_error_at_the_deadline(two_gpu_nodes, tmp_path):
    """Before the schedule deadline this run waited for as long as any GPU stayed busy: forever."""
    from orchestrator.executors.ray_executor import RayExecutor

    c, nodes = two_gpu_nodes
    ex = RayExecutor(schedule_timeout=4.0)
    try:
        assert len(ex.slots) == 2  # no --workers: one slot per alive GPU
        hold = ray.remote(num_cpus=1, num_gpus=1)(lambda: time.sleep(300))
        holders = [hold.remote() for _ in nodes]  # every GPU busy: the run waits
        deadline = time.monotonic() + 30
        while ray.available_resources().get("GPU", 0) > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        repo = contract.code_repo(tmp_path / "code")
        t = time.monotonic()
        handle = ex.submit(contract.job(repo, tmp_path / "out", [["{python}", "show.py"]]), ex.slots[0])
        c.remove_node(nodes[0], allow_graceful=False)
        assert handle.wait(30)
        result = handle.result(timeout=0)
        assert "did not start within 4s" in result.infra_error and not result.steps, result
        assert 4 <= time.monotonic() - t < 30 and not ray.wait(holders[1:], timeout=0)[0]  # the GPU left: busy
        while len(ex.slots) > 1 and time.monotonic() < t + 30:  # the next generation: the GPU left
            time.sleep(0.2)
        assert [s.index for s in ex.slots] == [0]
    finally:
        ex.close()
