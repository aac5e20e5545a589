"""The machine's load: the share of the CPU the runner measures for a run (executors/runner.CpuShare, real
processes pinned to one CPU), recorded by the controller only, and a run that waited on a busy machine set aside
and run again, a new configuration's first run too (judge.disturbance, State.set_aside)."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fakes
import pytest

from orchestrator.core.judge import Finished, decide
from orchestrator.core.noise import Gate
from orchestrator.core.state import CPU_OUTSIDE, CPU_SHARE, Kind, replay
from orchestrator.executors.runner import run_command
from orchestrator.store.ledger import Evidence, Record


def record(
    n: int,
    bpb: float,
    share: float | None,
    group: int = 0,
    decision: str = "repeat",
    params=1.0,
    outside=None,
    train: float = 40.0,
) -> Record:
    """A CPU run; a share below 0.8 was a busy machine's (other processes kept 1.9 CPUs busy) unless `outside`."""
    metrics = {"num_steps": 100, "training_seconds": 10.0, "total_tokens_M": 10.0, "num_params_M": params}
    if share is not None:
        metrics[CPU_OUTSIDE] = outside if outside is not None else 1.9 if share < 0.8 else 0.05
    return Record(
        n=n,
        status="keep" if decision == "keep" else "discard",
        description=f"run {n}",
        commit=f"c{group or n}",
        val_bpb=bpb,
        gate=Evidence(decision, runs=1),
        device="cpu",
        group=group,
        metrics=metrics if share is None else {**metrics, CPU_SHARE: share},
        timings={"train": train},
    )


# the baseline, run 3 times on a quiet machine
QUIET = [record(1, 2.0, 0.99, decision="keep"), record(2, 2.01, 0.98, group=1), record(3, 1.99, 0.99, group=1)]


def judged(run: Record, session=QUIET, kind=Kind.CANDIDATE, mode="noise"):
    return decide(replay(list(session), "c0"), [Finished(run, kind)], Gate(mode))[0].gate


@pytest.mark.parametrize("mode", ["noise", "value", "strict"])
def test_a_new_configurations_run_on_a_busy_machine_is_run_again_not_judged(mode):
    # a bigger model (its tokens per second cannot be compared with the best's), run while two other jobs took
    # the CPU: by luck of the timing it scored far better; its steps say nothing (no twins), its share does
    lucky = record(4, 1.80, 0.63, params=2.0)
    gate = judged(lucky, mode=mode)
    assert str(gate.decision) == "rerun" and "the CPU 63% of the time" in gate.disturbed, gate
    assert "kept 1.9 CPUs busy" in gate.disturbed
    # the same run with the CPU to itself is judged (and, so much better, kept or run again as promising)
    assert not judged(record(4, 1.80, 0.97, params=2.0), mode=mode).disturbed
    # a second run of it on the busy machine is its configuration's own: judged (the benefit of the doubt once)
    first = record(4, 1.80, 0.63, params=2.0)
    first.gate = Evidence("rerun", runs=1, disturbed="disturbed: it had the CPU 63% of the time")
    again = record(5, 1.95, 0.64, group=4, params=2.0)
    assert not judged(again, [*QUIET, first], Kind.RERUN, mode).disturbed


def test_a_share_below_the_usual_only_where_the_usual_is_known():
    assert not judged(record(4, 1.8, 0.63), QUIET[:1]).disturbed  # one other run: nothing to compare with
    busy = [record(1, 2.0, 0.62, decision="keep"), record(2, 2.01, 0.66, group=1), record(3, 1.99, 0.64, group=1)]
    assert not judged(record(4, 1.8, 0.63), busy).disturbed  # the machine is busy all night: that is its usual
    assert not judged(record(4, 1.8, None), QUIET).disturbed  # not measured (another platform): as before
    assert not judged(record(4, 1.8, 0.86), QUIET).disturbed  # 87% of the median: within a quiet machine's scatter
    # a train.py that pins its own threads beside each other lowers its share itself: nobody else was busy
    assert not judged(record(4, 1.8, 0.63, outside=0.05), QUIET).disturbed
    # a training step of a few seconds: its share is mostly its start-up's, and says little of the machine
    assert not judged(record(4, 1.8, 0.63, train=5.0), QUIET).disturbed


def test_a_first_run_that_waited_on_a_busy_machine_leaves_the_mean_once_its_twins_show_the_usual():
    # the first baseline run waited for the CPU (nothing to compare it with when it was judged), its steps alike
    runs = [record(1, 1.8, 0.6, decision="keep"), record(2, 2.01, 0.98, group=1), record(3, 1.99, 0.99, group=1)]
    state = replay(runs, "c0")
    assert state.set_aside == {1} and state.runs(1) == [2.01, 1.99]
    assert state.baseline_run == 3  # its saved model no longer stands for the baseline


def slow(run: Record, steps: float = 20, tokens: float = 20.0) -> Record:
    """The run as its train.py printed it: far fewer steps and tokens in its training seconds than its twins."""
    run.metrics.update(num_steps=steps, total_tokens_M=tokens)
    return run


def test_a_low_step_count_train_py_prints_is_believed_only_beside_others_load():
    # a candidate whose train.py prints few steps on the runs it finds unlucky (its training loss is high), so that
    # they leave its mean: on a machine nobody else kept busy, what it printed sets nothing aside
    mine = [record(4, 1.80, 0.99, decision="rerun"), record(5, 1.81, 0.98, group=4, decision="rerun")]
    unlucky = slow(record(6, 2.10, 0.99, group=4, decision="rerun"))
    state = replay([*QUIET, *mine, unlucky], "c0")
    assert not state.set_aside and 2.10 in state.runs(4)
    assert not judged(slow(record(6, 2.10, 0.99, group=4)), [*QUIET, *mine], Kind.RERUN).disturbed
    # a new configuration's first run, its tokens per second against the best's at the same model size, alike
    fast = copy.deepcopy(QUIET)
    for run in fast:
        run.metrics["total_tokens_M"] = 100.0
    assert not judged(slow(record(4, 2.10, 0.99)), fast).disturbed
    # where other users did keep the machine busy (memory or caches shared, its own thread never kept waiting),
    # a run that far slower than its twins was slowed from outside: set aside, or run again
    busy = slow(record(6, 2.10, 0.99, group=4, decision="rerun", outside=1.4))
    assert replay([*QUIET, *mine, busy], "c0").set_aside == {6}
    gate = judged(slow(record(6, 2.10, 0.99, group=4, outside=1.4)), [*QUIET, *mine], Kind.RERUN)
    assert gate.disturbed.startswith("disturbed: steps per second 20% of its twins' median") and "1.4 CPUs" in (
        gate.disturbed
    )
    assert judged(slow(record(4, 2.10, 0.99, outside=1.4)), fast).disturbed.startswith("disturbed: tokens per second")


def test_the_loop_records_the_share_it_measured_never_one_train_py_printed(fake_repo, plan):
    from orchestrator.loop import Settings, run_loop
    from orchestrator.store.ledger import read_record
    from orchestrator.store.session import Paths

    # a train.py that spins for 1.5 s and then claims it got 1% of the CPU (a bid for the load's credit)
    spin = "end = time.monotonic() + 1.5\nwhile time.monotonic() < end:\n    pass\n"
    claims = fakes.ok(0.9).replace("time.sleep(SLEEP)\n", spin) + 'print("cpu_share:        0.01")\n'
    repo = fake_repo(fakes.ok(1.0))
    short = fakes.ok(0.95) + 'print("cpu_share:        0.01")\n'  # over before the runner's first reading
    plan([{"description": "claims a loaded machine", "train": claims}, {"description": "and quickly", "train": short}])
    settings = Settings(repo=repo, tag="t1", budget=2.0, timeout=30.0, proposer="fakes:Scripted", baseline_repeats=0)
    run_loop(settings, echo=lambda _line: None)
    measured = read_record(Paths(repo, "t1").run_dir(2)).metrics[CPU_SHARE]
    assert measured != 0.01 and 0.1 < measured <= 1.0
    assert read_record(Paths(repo, "t1").run_dir(3)).metrics.get(CPU_SHARE) != 0.01


PINNED = textwrap.dedent(
    """
    import os, sys, time
    how = sys.argv[1]
    os.sched_setaffinity(0, [PINNED_CPU])
    for _ in range({"alone": 0, "busy": 1, "idle": 3}[how]):
        if os.fork() == 0:  # another process of the run, on the same CPU
            if how == "idle":  # at the lowest priority: it waits whenever the training loop runs
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            end = time.monotonic() + 2.5
            while time.monotonic() < end:
                pass
            os._exit(0)
    end = time.monotonic() + 2.5  # the training loop
    while time.monotonic() < end:
        pass
    """
)

BURN = "import os, time\nos.sched_setaffinity(0, CPUS)\nend = time.monotonic() + 6\nwhile time.monotonic() < end:\n    pass\n"


def measured(tmp_path: Path, how: str) -> tuple[float, float]:
    cpus = sorted(os.sched_getaffinity(0))
    script = tmp_path / "pinned.py"
    script.write_text(PINNED.replace("PINNED_CPU", str(cpus[0])))
    burners = []
    if how == "outside":  # another user's jobs (not ours: orphaned at once): one on the run's CPU, one anywhere
        burners = [fakes.orphan(BURN.replace("CPUS", str(c))) for c in ([cpus[0]], cpus)]
        time.sleep(0.3)
    try:
        log = tmp_path / f"{how}.log"
        result = run_command(
            [sys.executable, str(script), "alone" if burners else how], tmp_path, {**os.environ}, log, 30
        )
    finally:
        for pid in burners:
            os.kill(pid, 9)
    assert result.exit_code == 0, log.read_text()
    assert result.cpu_share is not None and result.cpu_outside is not None
    return result.cpu_share, result.cpu_outside


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux schedstat")
def test_the_runner_measures_the_share_of_the_cpu_a_run_got_and_what_others_took(tmp_path: Path):
    (alone, _), (shared, _), (idle, _) = (measured(tmp_path, how) for how in ("alone", "busy", "idle"))
    # two busy processes on one CPU: each ran about half of the time it was ready to
    assert shared < 0.65 and alone > shared + 0.1, (alone, shared)
    # processes that only wait, at the lowest priority, do not make the training loop look slowed: the share
    # is that of the thread that ran the most (summed over threads it would read about 0.3)
    assert idle > shared + 0.1, (idle, shared)
    # another user's jobs on the machine: the run waited, and the CPUs they kept busy are counted as outside
    share, outside = measured(tmp_path, "outside")
    assert share < 0.7 and outside >= 0.7, (share, outside)


def test_the_kernels_helpers_and_every_autoloop_run_are_not_other_users_load():
    """What a run can have started outside its own tree is not another user's load: the user-space helpers the
    kernel spawns under kthreadd (a core-dump helper for each crash where core_pattern is a pipe, modprobe for a
    socket of an unknown family), nor the runs of another slot on a Ray or Slurm node (under their reaper)."""
    from orchestrator.executors.runner import PF_KTHREAD, theirs

    seen = {  # pid -> (parent, flags, start time, CPU ticks)
        1: (0, 0, 1, 5),  # init
        2: (0, PF_KTHREAD, 1, 0),  # kthreadd
        80: (2, PF_KTHREAD, 2, 9),  # a kernel thread
        100: (1, 0, 50, 7),  # the controller ...
        101: (100, 0, 60, 90),  # ... its run
        500: (2, 0, 70, 40),  # apport, for a crash of the run's child
        501: (500, 0, 71, 30),  # ... and what it starts
        300: (1, 0, 40, 1),  # another slot's reaper (a Ray worker's run)
        301: (300, 0, 41, 80),  # ... its train.py
        302: (301, 0, 42, 20),  # ... and a data loader of it
        700: (1, 0, 30, 60),  # another user's job
    }
    assert theirs(seen, 100, {300}) == {1: (1, 5), 700: (30, 60)}
    assert set(theirs(seen, 100)) == {1, 300, 301, 302, 700}  # (reapers unknown: another slot's run is theirs)
    # in a container's PID namespace pid 2 is anybody's (kthreadd and its helpers are out of sight)
    contained = {1: (0, 0, 1, 5), 2: (1, 0, 3, 50), 3: (2, 0, 4, 9), 100: (1, 0, 50, 7), 101: (100, 0, 60, 90)}
    assert set(theirs(contained, 100)) == {1, 2, 3}


def test_a_reaper_is_known_by_its_command_line(tmp_path: Path):
    from orchestrator.executors.runner import is_reaper, under_reaper

    proc = subprocess.Popen(under_reaper([sys.executable, "-c", "import time; time.sleep(5)"]))
    try:
        deadline = time.monotonic() + 5
        while not is_reaper(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_reaper(proc.pid) and not is_reaper(os.getpid())
    finally:
        proc.terminate()
        proc.wait()


def test_a_run_dumps_no_core_not_even_to_a_pipe(tmp_path: Path):
    # RLIMIT_CORE 1 (hard): no core file, and no core_pattern pipe's helper (the kernel skips it at exactly 1)
    code = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CORE))\n"
    log = tmp_path / "core.log"
    result = run_command([sys.executable, "-c", code], tmp_path, {**os.environ}, log, 30)
    assert result.exit_code == 0 and log.read_text().strip() == "(1, 1)", log.read_text()


def test_the_others_are_every_process_but_ours_and_the_kernels():
    """outside() counts the CPU time of the processes that are neither the controller nor its descendants: what
    a run starts, however it detaches or ends (a child the kernel reaps unwaited, its SIGCHLD ignored), is never
    the others'; another user's job, orphaned in a session of its own, is."""
    from orchestrator.executors.runner import others_now

    code = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"  # its children are reaped by the kernel, unwaited
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True)\n"
        "print(child.pid, flush=True)\ntime.sleep(30)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    theirs = fakes.orphan("import time; time.sleep(30)")
    try:
        ours = int(run.stdout.readline())
        deadline = time.monotonic() + 10
        while theirs not in (others := others_now(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert theirs in others and run.pid not in others and ours not in others
        assert os.getpid() not in others and 2 not in others  # the controller, and kthreadd (a kernel thread)
    finally:
        os.kill(theirs, 9)
        run.kill()
        run.wait()


def namespaced(code: str, mount: str = "", user: str = "") -> subprocess.CompletedProcess:
    """Python `code` run in a PID namespace of its own with its own /proc (mounted with `mount`'s options), as
    in a container: the machine's other processes are out of its sight; with `user` (UID:GID), as that user (a
    user namespace of its own). Skips where these namespaces or the mount are not allowed."""
    script = f'mount -t proc {mount} proc /proc && exec "$@"'
    argv = ["unshare", "--pid", "--fork", "--mount"] + ([] if os.geteuid() == 0 else ["--user", "--map-root-user"])
    if (
        shutil.which("unshare") is None
        or subprocess.run([*argv, "sh", "-c", script, "sh", "true"], capture_output=True).returncode
    ):
        pytest.skip("needs unshare, PID namespaces and a /proc of their own")
    as_user = []
    if user:
        uid, gid = user.split(":")
        as_user = ["unshare", "--user", f"--map-user={uid}", f"--map-group={gid}"]
    command = [*argv, "sh", "-c", script, "sh", *as_user, sys.executable, "-c", code]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_doctor_warns_where_other_processes_load_is_out_of_sight():
    """`autoloop doctor`'s load check: two busy processes of another user are in sight here (no warning), and out
    of sight from a container's PID namespace, whose runs they would slow unseen (a warning naming that load)."""
    from orchestrator.doctor import check_load
    from orchestrator.executors.runner import hidden_load

    if (hidden_load() or 0.0) >= 0.5:
        pytest.skip("this machine already has load out of sight")
    code = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    burners = [fakes.orphan(code) for _ in "ab"]
    try:
        time.sleep(0.5)
        assert check_load(seconds=2.0).status == "ok"
        inside = namespaced(
            "from orchestrator.doctor import check_load; f = check_load(seconds=2.0); print(f.status, f.detail)"
        )
        assert inside.stdout.startswith("warn"), inside.stdout + inside.stderr
        busy = float(inside.stdout.split()[1])
        assert busy >= 0.5 and "out of sight" in inside.stdout
    finally:
        for pid in burners:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def test_a_proc_mounted_with_hidepid_hides_other_users_processes_from_all_but_root_and_its_group():
    from orchestrator.doctor import hides_processes

    code = "from orchestrator.doctor import hides_processes; print(hides_processes())"
    if hides_processes():
        pytest.skip("this machine's /proc already hides processes")
    assert namespaced(code, "-o hidepid=2", user="1000:1000").stdout.strip() == "True"
    assert namespaced(code, "-o hidepid=invisible,gid=1000", user="1000:1000").stdout.strip() == "False"  # its group
    assert namespaced(code, "-o hidepid=2", user="0:0").stdout.strip() == "False"  # root sees every process
    assert namespaced(code, user="1000:1000").stdout.strip() == "False"
