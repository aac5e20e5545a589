"""The executor contract on the local executor and, where Ray is installed, on a local Ray cluster."""

from __future__ import annotations

import contextlib
import json
import time

import psutil
import pytest

from orchestrator import contract
from orchestrator.executors import LocalExecutor, make_executor
from orchestrator.executors.local import local_slots

CHECKS = [
    contract.check_steps_logs_outputs,
    contract.check_watched_files,
    contract.check_timeout_kills_tree,
    contract.check_cancel,
]


@pytest.fixture(scope="module")
def ray_executor():
    ray = pytest.importorskip("ray")
    from orchestrator.executors.ray_executor import RayExecutor

    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield RayExecutor(workers=2)
    finally:
        ray.shutdown()


# contract.HANG's grandchild stays in the step's process group, where killing the group alone ends it. Here it
# leaves the group (start_new_session, as a DataLoader worker or a server that calls setsid does): only a kill
# that follows the tree beyond the group (the reaper on Linux, kill_tree's descendants elsewhere) ends it.
HANG_OUTSIDE_GROUP = contract.HANG.replace(
    '"import time; time.sleep(600)"])', '"import time; time.sleep(600)"], start_new_session=True)'
)
assert HANG_OUTSIDE_GROUP != contract.HANG


@pytest.fixture
def code(tmp_path):
    repo = contract.code_repo(tmp_path / "code")
    (repo / "hang.py").write_text(HANG_OUTSIDE_GROUP)
    yield repo
    for pids in tmp_path.rglob("*.pids"):  # a failed kill check leaves no 600 s sleeper behind
        for pid in pids.read_text().split():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(int(pid))
                if "hang.py" in proc.cmdline() or "import time; time.sleep(600)" in proc.cmdline():  # not reused
                    proc.kill()


@pytest.fixture(params=[True, False], ids=["reaper", "no-reaper"])
def reaper(request, monkeypatch):
    """Runs under the reaper (Linux), or without it: the path of every other system, where kill_tree alone
    must find what the step started (so each kill check fails if kill_tree stops looking beyond the group)."""
    from orchestrator.executors import runner

    monkeypatch.setattr(runner, "REAPER", request.param)
    return request.param


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_local_executor(check, code, tmp_path, reaper):
    check(LocalExecutor(workers=2, gpus=["0", "1"]), code, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_ray_executor(check, ray_executor, code, tmp_path):
    check(ray_executor, code, tmp_path)


def test_the_inline_debug_executor_passes_the_shipped_contract(tmp_path):
    from orchestrator.executors.inline import InlineExecutor

    contract.check_executor(make_executor("inline"), tmp_path)
    assert isinstance(make_executor("inline"), InlineExecutor) and len(make_executor("inline").slots) == 1
    with pytest.raises(ValueError, match="one slot"):
        make_executor("inline", workers=2)


def test_executors_are_plugins(tmp_path):
    """Built-ins are registered like third-party executors; an unknown name lists them."""
    from orchestrator import LoopError, plugins

    assert {"local", "ray", "inline"} <= set(plugins.available("executor"))
    assert {o.name for o in plugins.options("executor")} >= {"gpus", "ray_address", "ray_schedule_timeout"}
    with pytest.raises(LoopError, match="unknown executor 'nope'; available: .*inline.*local"):
        make_executor("nope")
    local = make_executor("local", 2, {"gpus": []})
    assert [s.label for s in local.slots] == ["cpu", "cpu"]


def test_local_slots_pin_their_gpus(code, tmp_path):
    seen = contract.check_own_gpus(LocalExecutor(workers=2, gpus=["3", "5"]), code, tmp_path)
    assert seen == ["'3'", "'5'"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in local_slots(2, ["0", "1", "2", "3"])] == ["0,1", "2,3"]


def test_cpu_slots_share_the_cores(monkeypatch):
    from orchestrator.executors import local

    cores = local.cpu_count()
    slots = local_slots(2, [])
    assert all(s.env["CUDA_VISIBLE_DEVICES"] == "" for s in slots)
    assert [int(s.env["OMP_NUM_THREADS"]) for s in slots] == [max(1, cores // 2)] * 2  # this machine's cores
    for machine, workers, each in ((8, 2, 4), (8, 3, 2), (16, 4, 4), (2, 4, 1)):  # at least one thread a slot
        monkeypatch.setattr(local, "cpu_count", lambda machine=machine: machine)
        assert [s.env["OMP_NUM_THREADS"] for s in local_slots(workers, [])] == [str(each)] * workers, machine
    assert local_slots(1, [])[0].env == {}  # one slot: the machine as it is (an AMD GPU stays visible)
    assert LocalExecutor(workers=1, gpus=[]).slots[0].env == {"CUDA_VISIBLE_DEVICES": ""}  # --gpus '': none
    with pytest.raises(ValueError, match="--workers 3 needs at least 3 GPUs"):
        local_slots(3, ["0", "1"])


@pytest.mark.slow
def test_ray_tasks_get_their_own_gpu(ray_executor, code, tmp_path):
    seen = contract.check_own_gpus(ray_executor, code, tmp_path)
    assert sorted(seen) == ["'0'", "'1'"]


# A prepare.py that notes when it ran (start, end) in the cache; `--check` always fails, so each task prepares.
SLOW_PREPARE = """
import os, sys, time
start = time.time()
time.sleep(0.5)
if os.environ.get("AUTOLOOP_FAKE_PREPARE") == "fail" and "--check" not in sys.argv:
    print("OSError: no route to the dataset host")
    sys.exit(2)
with open(os.path.join(os.environ["AUTOLOOP_CACHE"], "times"), "a") as f:
    f.write(f"{start} {time.time()}\\n")
sys.exit(1 if "--check" in sys.argv else 0)
"""


@pytest.mark.slow
def test_ray_tasks_on_one_node_prepare_one_at_a_time(ray_executor, tmp_path):
    """Two runs starting at once on one node share its cache: their prepare.py calls (check, then prepare) never
    overlap, and the runs go on."""
    repo = contract.make_git_repo(tmp_path / "code", {"prepare.py": SLOW_PREPARE, "show.py": contract.SHOW})
    cache = tmp_path / "cache"
    handles = [
        ray_executor.submit(
            contract.job(repo, tmp_path / f"out{s.index}", [["{python}", "show.py"]], AUTOLOOP_CACHE=str(cache)), s
        )
        for s in ray_executor.slots
    ]
    assert all(h.result(timeout=120).ok for h in handles)
    spans = sorted(tuple(map(float, line.split())) for line in (cache / "times").read_text().splitlines())
    assert len(spans) == 4 and all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans


@pytest.mark.slow
def test_a_failed_prepare_on_a_ray_node_is_an_infra_error_naming_its_log(ray_executor, tmp_path):
    repo = contract.make_git_repo(tmp_path / "code", {"prepare.py": SLOW_PREPARE, "show.py": contract.SHOW})
    out = tmp_path / "out"
    result = ray_executor.submit(
        contract.job(repo, out, [["{python}", "show.py"]], AUTOLOOP_CACHE=str(tmp_path), AUTOLOOP_FAKE_PREPARE="fail"),
        ray_executor.slots[0],
    ).result(timeout=120)
    assert not result.steps and "prepare.py failed on" in result.infra_error, result
    assert "exit code 2: OSError: no route to the dataset host" in result.infra_error
    assert result.infra_error.endswith(f"see {out / 'prepare.log'}")
    assert "no route" in (out / "prepare.log").read_text()


@pytest.mark.slow
def test_a_ray_run_that_started_outlives_the_schedule_timeout(ray_executor, code, tmp_path):
    from orchestrator.executors.ray_executor import RayExecutor

    ex = RayExecutor(workers=2, schedule_timeout=4.0)  # the same local Ray: a started run is never cancelled
    try:
        t = time.monotonic()
        result = ex.submit(
            contract.job(code, tmp_path / "out", [["{python}", "show.py"]], AUTOLOOP_SLEEP="6"), ex.slots[0]
        ).result(timeout=60)
        assert result.ok and not result.infra_error and time.monotonic() - t > 6, result
    finally:
        ex.close()


PEEK = """
import os, sys
for path in sys.argv[1:]:
    try:
        print(path, len(open(path, "rb").read()) if os.path.isfile(path) else len(os.listdir(path)))
    except FileNotFoundError:  # out of sight altogether (the sandbox shows only what a run needs)
        print(path, "0")
    except OSError as e:
        print(path, "unreadable", e)
"""


@pytest.mark.slow
def test_a_sandboxed_ray_run_cannot_read_what_it_is_scored_on(ray_executor, tmp_path, monkeypatch):
    """On a Ray node the training step's sandbox hides what the controller lists (Job.step_hidden) and the
    validation data and corpus sources of every manifest prepared in the node's cache."""
    from orchestrator.trust import confine

    monkeypatch.delitem(confine._PROBE, "result", raising=False)  # the suite's default: unconfined
    if problem := confine.sandbox_problem():
        pytest.skip(f"no sandbox here: {problem}")
    sources, cache = tmp_path / "sources", tmp_path / "cache"
    secret = cache / "listed.bin"  # in a directory the run may read (the data cache)
    cache.mkdir()
    secret.write_bytes(b"x" * 100)
    (sources / "test").mkdir(parents=True)
    (sources / "test" / "test_a.py").write_text("assert 1\n")
    (cache / "c" / "data").mkdir(parents=True)
    (cache / "c" / "data" / "val.parquet").write_bytes(b"v" * 50)
    (cache / "c" / "manifest-tiny.json").write_text(
        json.dumps({"splits": {"val": ["val.parquet"], "holdout": []}, "hidden_sources": [str(sources / "test")]})
    )
    repo = contract.make_git_repo(tmp_path / "code", {"peek.py": PEEK})
    paths = [str(secret), str(cache / "c" / "data" / "val.parquet"), str(sources / "test")]
    job = contract.job(repo, tmp_path / "out", [["{python}", "peek.py", *paths]], AUTOLOOP_CACHE=str(cache))
    job.sandbox, job.step_hidden = {"net": False, "required": True}, [(str(secret),)]
    result = ray_executor.submit(job, ray_executor.slots[0]).result(timeout=120)
    assert result.ok, result
    seen = dict(line.rsplit(" ", 1) for line in (tmp_path / "out" / "step0.log").read_text().splitlines())
    assert seen == {path: "0" for path in paths}, seen
