"""The sandbox holds as root (P14): each test is an attack a train.py made, as root, from inside P11's sandbox
(bubblewrap with the filesystem read-only, nothing else), run for real through run_steps (one through the loop).

Each attack runs as the user of the tests (root here, as the controller often is) and, where `setpriv` can drop
to uid 65534, as an unprivileged user too (bwrap itself run as that user). The step prints what it tried and what
it managed; a test fails on anything managed.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import fakes
import psutil
import pytest
from conftest import ROOT, make_repo

from orchestrator.executors import base
from orchestrator.executors.base import Job, JobResult, run_steps
from orchestrator.trust import confine

needs_bwrap = pytest.mark.skipif(
    confine.sandbox_problem() != "", reason=f"bubblewrap cannot run here ({confine.sandbox_problem()})"
)
NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]

# What every attack starts with: attempt(name, fn) records `name` as managed when fn returns (and what it got);
# need(x) raises where x is empty, check(rc) where a libc call failed.
PRELUDE = """
import ctypes, json, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
got, tried, errors = {}, [], {}

def attempt(name, fn):
    tried.append(name)
    try:
        got[name] = repr(fn())[:300]
    except Exception as e:
        errors[name] = f"{type(e).__name__}: {e}"[:200]

def need(value):
    if not value:
        raise LookupError("nothing")
    return value

def check(rc):
    if rc != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return rc

"""
DONE = '\nprint("RESULT " + json.dumps({"got": got, "tried": tried, "errors": errors}), flush=True)\n'


def outcome(log: str) -> dict:
    """The step's RESULT line: what it tried, got, and the errors that stopped it."""
    lines = [line for line in log.splitlines() if line.startswith("RESULT ")]
    assert lines, f"the attack did not finish:\n{log[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def can_drop_to_nobody(python: str) -> str:
    """'' where this test process may run a command as uid 65534 that runs `python`, else why not."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return "needs root and setpriv to run bwrap as an unprivileged user"
    proc = subprocess.run([*SETPRIV, python, "-c", "pass"], capture_output=True)
    return "" if proc.returncode == 0 else f"uid {NOBODY} cannot run {python}"


@dataclass
class Box:
    """One attack's ground: a git repository with the step's worktree (its .git a file), an out directory, all
    under /tmp (which the sandbox empties: the repository is bound back read-only, like a project elsewhere)."""

    base: Path
    repo: Path
    work: Path
    out: Path
    python: str
    user: str

    def run(
        self,
        code: str | list[str],
        hidden: list[tuple[str, ...]] | None = None,
        env: dict | None = None,
        readable: tuple[str, ...] = (),
        read_only: tuple[str, ...] = (),
        timeout: float = 60.0,
        net: bool = False,
        stdin: list[str | None] | None = None,
        start_after: list[str | None] | None = None,
        watch: tuple[str, ...] = (),
    ) -> tuple[JobResult, list[str]]:
        """Run each code as a step (attack_<i>.py in the worktree) in the sandbox; the result and each step's log."""
        codes = [code] if isinstance(code, str) else code
        for i, source in enumerate(codes):
            (self.work / f"attack_{i}.py").write_text(PRELUDE + source + DONE)
            self.own(self.work / f"attack_{i}.py")
        job = Job(
            steps=[[self.python, f"attack_{i}.py"] for i in range(len(codes))],
            logs=[f"step{i}.log" for i in range(len(codes))],
            # {out}: the steps' directory is theirs to write (these attacks leave signs there), see Job.outputs
            env={**confine.allowed_env(), "HOME": str(self.out), "AUTOLOOP_OUT": "{out}", **(env or {})},
            timeout_s=timeout,
            workdir=self.work,
            out_dir=self.out,
            sandbox={"net": net, "required": True},
            step_hidden=hidden or [],
            readable=(str(self.base), *readable),
            read_only=read_only,
            step_stdin=stdin or [],
            step_start_after=start_after or [],
            watch=watch,
        )
        result = run_steps(job, self.work, self.out, {"CUDA_VISIBLE_DEVICES": ""})
        return result, [s.log.read_text() for s in result.steps]

    def attack(self, code: str, **kwargs) -> dict:
        """One step: it must exit 0 (the attack ran to its end); its outcome."""
        result, logs = self.run(code, **kwargs)
        assert result.steps and result.steps[0].exit_code == 0 and not result.infra_error, (result, logs)
        return outcome(logs[0])

    def own(self, path: Path) -> None:
        """Make path the step's own (the unprivileged user's) as the worktree and out directory are."""
        if self.user == "nobody":
            os.chown(path, NOBODY, NOBODY)


def tmp_dir() -> Path:
    """A fresh directory under /tmp (which the sandbox empties) that uid 65534 may enter."""
    path = Path(tempfile.mkdtemp(prefix="autoloop-sandbox-test-", dir="/tmp"))
    path.chmod(0o755)
    return path


def nobodys_python() -> str:
    """An interpreter uid 65534 may run (ours may lie in root's home)."""
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


@pytest.fixture(params=["us", "nobody"])
def user(request, monkeypatch):
    """Who runs bwrap: us (the controller's user: root here), or uid 65534 (an unprivileged controller)."""
    if request.param == "us":
        return "us"
    if why := can_drop_to_nobody(nobodys_python()):
        pytest.skip(why)
    real = base.sandboxed
    monkeypatch.setattr(base, "sandboxed", lambda *a, **k: [*SETPRIV, *real(*a, **k)])
    # an unprivileged controller's own Python (its venv, its packages) is one it can reach; ours (root's, e.g. a
    # venv under a 0700 directory such as `mktemp -d` makes) may not be, and bwrap run as uid 65534 could not
    # bind it back: the step runs nobody's Python (nobodys_python), so only what that user can reach is bound
    reaches: dict[str, bool] = {}

    def reachable(env: dict[str, str], python: str = "") -> list[str]:
        for path in (paths := real_readable(env, python)):
            if path not in reaches:
                reaches[path] = subprocess.run([*SETPRIV, "test", "-e", path], capture_output=True).returncode == 0
        return [path for path in paths if reaches[path]]

    real_readable = base.readable_paths
    monkeypatch.setattr(base, "readable_paths", reachable)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # ours: another user's bwrap could not even reach it
    return "nobody"


def make_box(user: str) -> Box:
    where = tmp_dir()
    repo = where / "repo"
    make_repo(repo, {"train.py": "print('hi')\n"})
    work = where / "work"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "-q", "--detach", str(work)], check=True)
    out = where / "out"
    out.mkdir()
    if user == "nobody":
        for path in (work, out, *work.rglob("*")):
            os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
    return Box(where, repo, work, out, nobodys_python() if user == "nobody" else sys.executable, user)


@pytest.fixture
def box(user):
    made = make_box(user)
    yield made
    shutil.rmtree(made.base, ignore_errors=True)


@pytest.fixture
def our_box():
    """A box for what only the controller's own user can check (the controller here is this test's Python)."""
    made = make_box("us")
    yield made
    shutil.rmtree(made.base, ignore_errors=True)


@needs_bwrap
def test_a_step_holds_no_capability_and_cannot_remount(box):
    """Old: root kept every capability in the sandbox: it remounted / read-write and wrote the repository."""
    result = box.attack(f'''
def capabilities():
    line = next(l for l in open("/proc/self/status") if l.startswith("CapEff"))
    return need(int(line.split()[1], 16))
attempt("capabilities", capabilities)
MS_REMOUNT, MS_BIND = 32, 4096
attempt("remount /", lambda: check(libc.mount(b"none", b"/", None, MS_REMOUNT, None)))
attempt("remount / (bind)", lambda: check(libc.mount(b"none", b"/", None, MS_REMOUNT | MS_BIND, None)))
attempt("/ writable", lambda: need(not os.statvfs("/").f_flag & os.ST_RDONLY))
attempt("write the repository", lambda: open("{box.repo}/escaped", "w").write("x"))
attempt("write /tmp", lambda: open("/tmp/escaped", "w").write("x"))  # empty, and read-only as before
attempt("a user namespace of its own", lambda: check(libc.unshare(0x10000000)))  # last: it changes the rest
''')
    assert len(result["tried"]) == 7
    allowed = set() if confine.sandbox_note() == "" else {"a user namespace of its own"}
    assert set(result["got"]) <= allowed, result
    assert not (box.repo / "escaped").exists()


@pytest.fixture
def our_netns(user):
    """Our network namespace bound on a file (as `ip netns` keeps one), where this test may mount: a handle on it
    that needs no view of our processes. None where it cannot be made."""
    where = tmp_dir()
    handle = where / "net"
    handle.touch()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "--bind", f"/proc/{os.getpid()}/ns/net", str(handle)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield handle if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(handle)], check=True)
        shutil.rmtree(where, ignore_errors=True)


@needs_bwrap
def test_a_step_cannot_join_our_network_namespace_nor_reach_our_loopback(box, our_netns):
    """Old: root in the sandbox joined the controller's network namespace (setns on /proc/<our pid>/ns/net, in the
    PID namespace and /proc it shared with us) and reached a local server. Here it tries every ns file it sees,
    and ours handed to it directly."""
    server = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0autoloop-test-{uuid.uuid4().hex}"
    abstract.bind(name)
    abstract.listen()
    handles = ["/proc/self/ns/net", "/proc/1/ns/net", *([str(our_netns)] if our_netns else [])]
    try:
        result = box.attack(
            f"""
def join(path):
    return check(libc.setns(os.open(path, os.O_RDONLY), 0x40000000))  # CLONE_NEWNET
for path in {handles!r} + [f"/proc/{{p}}/ns/net" for p in os.listdir("/proc") if p.isdigit() and p != "1"]:
    attempt(f"setns {{path}}", lambda: join(path))
attempt("loopback", lambda: socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), 3).close())
def abstract():
    s = socket.socket(socket.AF_UNIX)
    s.connect({name!r})
attempt("abstract socket", abstract)
""",
            readable=(str(our_netns.parent),) if our_netns else (),
        )
    finally:
        server.close()
        abstract.close()
    assert {f"setns {h}" for h in handles} | {"loopback", "abstract socket"} <= set(result["tried"]), result
    assert result["got"] == {}, result


@needs_bwrap
def test_with_the_network_on_a_step_reaches_it(box):
    """--sandbox-net: our network namespace, and the resolver's configuration (which may lie under /run)."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        result = box.attack(
            f"""
attempt("loopback", lambda: socket.create_connection(("127.0.0.1", {server.getsockname()[1]}), 3).close())
attempt("resolv.conf", lambda: open("/etc/resolv.conf").read() if os.path.exists("/etc/resolv.conf") else "none")
""",
            net=True,
        )
    finally:
        server.close()
    assert set(result["got"]) == {"loopback", "resolv.conf"}, result


@pytest.fixture
def neighbour(user):
    """A process of ours (as the sandbox's user) with a secret in its environment and a marker in its command."""
    secret, marker = f"sk-{uuid.uuid4().hex}", f"{time.time() % 1000 + 1000:.6f}"
    prefix = SETPRIV if user == "nobody" else []
    proc = subprocess.Popen([*prefix, "sleep", marker], env={"PATH": os.environ["PATH"], "OPENAI_API_KEY": secret})
    try:
        yield secret, marker
    finally:
        proc.kill()
        proc.wait()


SPIES = """
def seen(pid, part):
    with open(f"/proc/{pid}/{part}", "rb") as f:
        return f.read()
def listed():
    return [p for p in os.listdir("/proc") if p.isdigit()]
def chain():
    pids, pid = [], os.getppid()
    while pid > 0 and len(pids) < 20:
        pids.append(pid)
        pid = int(seen(pid, "stat").rsplit(b")", 1)[1].split()[1])
    return pids
def find(part, needle):
    hits = []
    for pid in sorted(set(listed()) | {str(p) for p in chain()}):
        try:
            if needle.encode() in seen(pid, part):
                hits.append(pid)
        except OSError:
            pass
    return need(hits)
"""


@needs_bwrap
def test_our_processes_and_their_environments_are_out_of_sight(box, neighbour):
    """Old: the step read OPENAI_API_KEY from the controller's /proc/<pid>/environ."""
    secret, marker = neighbour
    result = box.attack(
        SPIES
        + f"""
attempt("our processes", lambda: find("cmdline", {marker!r}))
attempt("their environments", lambda: find("environ", {secret!r}))
attempt("an ancestor outside", lambda: need([p for p in chain() if p != 1]))
attempt("our terminal session", lambda: need(os.getsid(0) == 0))  # led from outside: keys could be pushed into it
"""
    )
    assert len(result["tried"]) == 4 and result["got"] == {}, result


DRIVER = """
import json, sys
from pathlib import Path
from orchestrator.executors.base import Job, run_steps
spec = json.loads(sys.argv[1])
job = Job(**{**spec, "workdir": Path(spec["workdir"]), "out_dir": Path(spec["out_dir"])})
result = run_steps(job, job.workdir, job.out_dir, {})
sys.exit(0 if result.ok else 1)
"""


@needs_bwrap
def test_the_controllers_environment_is_out_of_reach_up_the_parent_chain(our_box):
    """The controller (a process with OPENAI_API_KEY in its environment) runs the step: neither os.getppid()'s
    chain nor a scan of /proc reaches it."""
    box = our_box
    secret = f"sk-{uuid.uuid4().hex}"
    (box.work / "attack.py").write_text(
        PRELUDE
        + SPIES
        + f"""
attempt("the controller's environment", lambda: find("environ", {secret!r}))
attempt("the controller", lambda: find("cmdline", "autoloop-driver"))
"""
        + DONE
    )
    spec = {
        "steps": [[sys.executable, "attack.py"]],
        "logs": ["run.log"],
        "env": confine.allowed_env(),
        "timeout_s": 60,
        "workdir": str(box.work),
        "out_dir": str(box.out),
        "sandbox": {"net": False, "required": True},
        "readable": [str(box.base)],
    }
    env = dict(os.environ, OPENAI_API_KEY=secret, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(spec), "autoloop-driver"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    log = (box.out / "run.log").read_text()
    assert proc.returncode == 0, proc.stderr + log
    result = outcome(log)
    assert len(result["tried"]) == 2 and result["got"] == {}, result
    assert secret not in log


@needs_bwrap
def test_our_sysv_shared_memory_is_out_of_sight(box):
    """A SysV shared memory segment of ours (CUDA IPC, a database, X11) is another namespace's."""
    libc = ctypes.CDLL(None, use_errno=True)
    key = int.from_bytes(os.urandom(3), "big") + 1
    segment = libc.shmget(key, 4096, 0o1000 | 0o666)  # IPC_CREAT, anyone may attach
    assert segment >= 0, os.strerror(ctypes.get_errno())
    try:
        result = box.attack(f"""
attempt("our shared memory", lambda: need(libc.shmget({key}, 0, 0) >= 0))
""")
    finally:
        libc.shmctl(segment, 0, None)  # IPC_RMID
    assert result["tried"] == ["our shared memory"] and result["got"] == {}, result


@pytest.fixture
def host_sockets(user, monkeypatch):
    """Listening Unix sockets where the host keeps them: /tmp, /run, /var/tmp, /dev/shm and $XDG_RUNTIME_DIR."""
    dirs = [tmp_dir()]
    for parent in ("/run", "/var/tmp", "/dev/shm"):
        if os.access(parent, os.W_OK):
            dirs.append(Path(tempfile.mkdtemp(prefix="autoloop-sandbox-test-", dir=parent)))
    if user == "us" and os.access(Path.home(), os.W_OK):  # a runtime directory outside every other mask
        runtime = Path(tempfile.mkdtemp(prefix=".autoloop-sandbox-test-", dir=Path.home()))
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
        dirs.append(runtime)
    servers, paths = [], []
    try:
        for where in dirs:
            where.chmod(0o777)
            server = socket.socket(socket.AF_UNIX)
            server.bind(str(where / "s.sock"))
            server.listen()
            os.chmod(where / "s.sock", 0o777)
            servers.append(server)
            paths.append(str(where / "s.sock"))
        yield paths
    finally:
        for server in servers:
            server.close()
        for where in dirs:
            shutil.rmtree(where, ignore_errors=True)


@needs_bwrap
def test_host_unix_sockets_are_out_of_reach(box, host_sockets):
    """Old: /tmp and /run were the host's: `tmux -S <socket> run-shell` ran a command outside the sandbox."""
    result = box.attack(f"""
def connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.close()
for path in {host_sockets!r}:
    attempt(path, lambda: connect(path))
""")
    assert result["tried"] == host_sockets and result["got"] == {}, result
    assert all("FileNotFoundError" in why for why in result["errors"].values()), result


BASIC_DEV = {
    "null",
    "zero",
    "full",
    "random",
    "urandom",
    "tty",
    "pts",
    "ptmx",
    "shm",
    "fd",
    "stdin",
    "stdout",
    "stderr",
    "core",
    "kfd",
    "dri",
}  # what bwrap's --dev makes, and ROCm's nodes where there are


@needs_bwrap
def test_dev_holds_the_basic_nodes_and_a_shared_memory_of_its_own(box):
    """Old: the whole /dev was bound in (disks, /dev/kmsg, loop devices), /dev/shm the host's."""
    ours = Path(tempfile.mkstemp(prefix="autoloop-sandbox-test-", dir="/dev/shm")[1])
    theirs = f"autoloop-sandbox-test-{uuid.uuid4().hex}"
    try:
        result = box.attack(f"""
extra = sorted(set(os.listdir("/dev")) - set({sorted(BASIC_DEV)!r}))
attempt("devices", lambda: need(extra))
attempt("the host's shared memory", lambda: need(os.listdir("/dev/shm")))
open("/dev/shm/{theirs}", "w").write("x")  # a step's processes still share memory
print("SHM", os.listdir("/dev/shm"))
""")
        assert not (Path("/dev/shm") / theirs).exists()
    finally:
        ours.unlink()
        (Path("/dev/shm") / theirs).unlink(missing_ok=True)
    assert len(result["tried"]) == 2 and result["got"] == {}, result


@needs_bwrap
def test_hidden_files_read_empty_for_their_step_only_and_what_it_reads_is_bound_back(box):
    """The training step may not read the validation data: bound over, it reads as an empty file (a directory as
    an empty one), and nothing in the cache can be written; the evaluation step reads it. The cache, a PYTHONPATH
    entry and a declared readable path lie under /tmp, which the sandbox empties: they are bound back."""
    data = tmp_dir()
    try:
        cache, lib, extra = data / "cache", data / "lib", data / "extra.txt"
        (cache / "holdout").mkdir(parents=True)
        (cache / "train.bin").write_text("train data")
        (cache / "val.bin").write_text("validation data")
        (cache / "holdout" / "part0.bin").write_text("held-out data")
        lib.mkdir()
        (lib / "helper_mod.py").write_text("VALUE = 'imported'\n")
        extra.write_text("extra")
        reads = f'''
attempt("val", lambda: need(open("{cache}/val.bin").read()))
attempt("holdout", lambda: need(os.listdir("{cache}/holdout")))
attempt("write the cache", lambda: open("{cache}/train.bin", "a").write("x"))
attempt("write the hidden file", lambda: open("{cache}/val.bin", "w").write("x"))
import helper_mod
print("READ", open("{cache}/train.bin").read(), helper_mod.VALUE, open("{extra}").read())
'''
        hidden = [(str(cache / "val.bin"), str(cache / "holdout"))]
        result, logs = box.run(
            [reads, reads],
            hidden=hidden,
            readable=(str(extra),),
            env={"AUTOLOOP_CACHE": str(cache), "PYTHONPATH": str(lib)},
        )
        assert [s.exit_code for s in result.steps] == [0, 0], logs
        train, evaluation = outcome(logs[0]), outcome(logs[1])
        assert len(train["tried"]) == 4 and train["got"] == {}, train
        assert set(evaluation["got"]) == {"val", "holdout"}, evaluation
        assert all("READ train data imported extra" in log for log in logs)
        assert (cache / "val.bin").read_text() == "validation data"
        assert (cache / "train.bin").read_text() == "train data"
    finally:
        shutil.rmtree(data, ignore_errors=True)


@needs_bwrap
def test_the_worktrees_git_file_cannot_be_rewritten(box):
    """Old: a run rewrote its worktree's .git (a gitfile pointing at the repository's gitdir for it). Read-only
    too: what the job names so ({out} for the run's directory)."""
    before = (box.work / ".git").read_text()
    (box.out / "input.bin").write_text("given")
    box.own(box.out / "input.bin")
    result = box.attack(
        f'''
attempt("rewrite .git", lambda: open(".git", "w").write("gitdir: /elsewhere\\n"))
open("other", "w").write("gitdir: /elsewhere\\n")
attempt("replace .git", lambda: os.replace("other", ".git"))
attempt("remove .git", lambda: os.unlink(".git"))
def hook():
    gitdir = open(".git").read().split("gitdir:")[1].strip()
    common = os.path.join(gitdir, open(os.path.join(gitdir, "commondir")).read().strip())
    path = os.path.join(common, "hooks", "post-checkout")
    open(path, "w").write("#!/bin/sh\\ntouch pwned\\n")
    return path
attempt("plant a hook", hook)
attempt("change a read-only input", lambda: open("{box.out}/input.bin", "w").write("changed"))
''',
        read_only=("{out}/input.bin",),
    )
    assert len(result["tried"]) == 5 and result["got"] == {}, result
    assert (box.out / "input.bin").read_text() == "given"
    assert (box.work / ".git").read_text() == before
    assert not (box.repo / ".git" / "hooks" / "post-checkout").exists()


def survivors(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def in_the_box(box: Box) -> list[psutil.Process]:
    """Live processes of this box's steps (another test's boxes, on another worker, are not ours): its paths in
    their command line (bwrap's, the reaper's) or their working directory in it (the step's own process)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
        if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if str(box.base) in " ".join(proc.info["cmdline"] or []) or (proc.info["cwd"] or "").startswith(str(box.base)):
            found.append(proc)
    return found


DAEMON = """
import os, sys, time
if os.fork() == 0:  # a daemon: its own session, its parent gone
    os.setsid()
    if os.fork() == 0:
        beat = "import sys, time\\nwhile True:\\n    open(sys.argv[1], 'a').write('.')\\n    time.sleep(0.05)"
        os.execv(sys.executable, [sys.executable, "-c", beat, {heartbeat!r}, {marker!r}])
    os._exit(0)
deadline = time.time() + 10
while not os.path.exists({heartbeat!r}) and time.time() < deadline:
    time.sleep(0.05)
{then}
"""


def bare_run(box: Box, code: str, timeout: float) -> bool:
    """The step's code in the sandbox as sandboxed() builds it, started and killed (on timeout) like any process,
    without run_command's reaper; True where it timed out."""
    (box.work / "step.py").write_text(code)
    argv = base.sandboxed(
        [box.python, str(box.work / "step.py")],
        [str(box.work), str(box.out)],
        False,
        readable=[str(box.base), *base.readable_paths({})],  # (as run_steps reads them)
        devices=[],
    )
    try:
        subprocess.run(
            argv,
            cwd=box.work,
            env=confine.allowed_env(),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:  # bwrap is killed (SIGKILL), nothing else
        return True
    return False


@needs_bwrap
@pytest.mark.parametrize("then", ["exits", "times out"])
@pytest.mark.parametrize("via", ["run_steps", "bwrap alone"])
def test_nothing_outlives_the_step(box, then, via):
    """Old: a setsid double fork outlived the run and the controller. run_command's reaper ends such processes
    too; "bwrap alone" shows the sandbox does it by itself (its PID namespace ends with the step)."""
    marker = f"autoloop-daemon-{uuid.uuid4().hex}"
    heartbeat = box.out / "heartbeat"
    code = DAEMON.format(
        heartbeat=str(heartbeat), marker=marker, then="time.sleep(0.3)" if then == "exits" else "time.sleep(3600)"
    )
    timeout = 3.0 if then == "times out" else 60.0
    try:
        if via == "run_steps":
            result, logs = box.run(code, timeout=timeout)
            timed_out = result.steps[0].timed_out
        else:
            timed_out, logs = bare_run(box, code, timeout), []
        assert timed_out == (then == "times out"), logs
        assert heartbeat.exists() and heartbeat.stat().st_size > 0, logs  # it ran
        size = heartbeat.stat().st_size
        time.sleep(0.5)
        assert heartbeat.stat().st_size == size, "the daemon still beats"
        assert survivors(marker) == []
    finally:
        for proc in survivors(marker):
            proc.kill()


# ---------------------------------------------------------------------------
# The evaluation started early: it gets ready while the training step exports, out of that step's reach
# ---------------------------------------------------------------------------

READY_LINE = "training is over"
EARLY_EVALUATION = """
import os, sys, time
open("{out}/evaluation-started", "w").write(repr(time.time()))
nonce = sys.stdin.readline().strip()  # its go: written once the training step has ended and passed its checks
print("TOLD", repr(nonce), repr(time.time()), flush=True)
"""


@needs_bwrap
def test_an_evaluation_started_early_is_out_of_the_training_steps_reach(box):
    """The evaluation step starts when the training step prints READY_LINE (the export begins), so its imports
    overlap the export. The training step, still running, cannot see it, touch the harness's code (read-only:
    the evaluation may still be reading it), or read its go; the go comes only after the training step ended."""
    evaluation = EARLY_EVALUATION.format(out=box.out)
    training = f"""
print({READY_LINE!r}, flush=True)
deadline = time.time() + 30
while not os.path.exists("{box.out}/evaluation-started") and time.time() < deadline:
    time.sleep(0.02)
attempt("the evaluation started while training ran", lambda: need(os.path.exists("{box.out}/evaluation-started")))
attempt("see the evaluation", lambda: need([p for p in os.listdir("/proc") if p.isdigit()
                                            and b"attack_1.py" in open(f"/proc/{{p}}/cmdline", "rb").read().split(b"\\0")]))
attempt("change the harness", lambda: open("attack_1.py", "a").write("\\nprint('forged')\\n"))
open("forged.py", "w").write("print('forged')\\n")
attempt("replace the harness", lambda: os.replace("forged.py", "attack_1.py"))
attempt("remove the harness", lambda: os.unlink("attack_1.py"))
time.sleep(0.3)
print("ENDED", repr(time.time()), flush=True)
"""
    harness = box.work / "attack_1.py"
    result, logs = box.run(
        [training, evaluation],
        stdin=[None, "nonce-1234\n"],
        start_after=[None, READY_LINE],
        read_only=("attack_1.py",),
    )
    assert [s.exit_code for s in result.steps] == [0, 0], logs
    attack = outcome(logs[0])
    assert len(attack["tried"]) == 5, attack
    assert list(attack["got"]) == ["the evaluation started while training ran"], attack  # and nothing else
    assert "TOLD 'nonce-1234'" in logs[1] and "forged" not in logs[1], logs[1]
    ended = float(logs[0].split("ENDED ")[1].split()[0])
    told = float(logs[1].split("TOLD 'nonce-1234' ")[1].split()[0])
    assert told > ended, (told, ended)  # the go came after the training step's end
    assert "forged" not in harness.read_text()


@needs_bwrap
@pytest.mark.parametrize("ending", ["fails", "changes a watched file"])
def test_an_evaluation_started_early_is_called_off_when_training_fails(box, ending):
    """A training step that prints READY_LINE and then fails (or changes what it may not): the evaluation that
    started gets no go (its stdin closes empty), is not part of the result, and nothing of it lives on."""
    evaluation = EARLY_EVALUATION.format(out=box.out)
    end = "sys.exit(1)" if ending == "fails" else 'open("train.py", "a").write("# changed\\n")'
    training = f"""
print({READY_LINE!r}, flush=True)
deadline = time.time() + 30
while not os.path.exists("{box.out}/evaluation-started") and time.time() < deadline:
    time.sleep(0.02)
{end}
"""
    result, logs = box.run(
        [training, evaluation],
        stdin=[None, "nonce\n"],
        start_after=[None, READY_LINE],
        watch=("train.py",),
        read_only=("attack_1.py",),
    )
    assert (box.out / "evaluation-started").exists(), logs  # it did start early
    assert len(result.steps) == 1, result
    assert (result.steps[0].exit_code == 1) if ending == "fails" else (result.modified == ["train.py"]), result
    told = (box.out / "step1.log").read_text()
    assert "nonce" not in told, told  # stdin closed with nothing written (it may be gone before it says so)
    assert in_the_box(box) == []


@needs_bwrap
def test_an_evaluation_whose_code_the_training_step_could_change_never_starts_early(box):
    """The interlock: a step may start early only if its code in the worktree is read-only to the step before
    (here it is not named so), else it starts after that step, as unconfined."""
    evaluation = EARLY_EVALUATION.format(out=box.out)
    training = f"print({READY_LINE!r}, flush=True)\ntime.sleep(1.0)\nprint('ENDED', repr(time.time()), flush=True)\n"
    result, logs = box.run([training, evaluation], stdin=[None, "n\n"], start_after=[None, READY_LINE])
    assert [s.exit_code for s in result.steps] == [0, 0], logs
    started = float((box.out / "evaluation-started").read_text())
    assert started > float(logs[0].split("ENDED ")[1].split()[0])


def held_evaluation(
    box: Box, training: str, timeout: float = 60.0, cancel: threading.Event | None = None, then: str = ""
) -> JobResult:
    """training, then EARLY_EVALUATION (and `then`) started on READY_LINE, its code read-only: the job's result,
    run directly (with a cancel event of the caller's)."""
    for i, source in enumerate([training, EARLY_EVALUATION.format(out=box.out) + then]):
        (box.work / f"attack_{i}.py").write_text(PRELUDE + source + DONE)
        box.own(box.work / f"attack_{i}.py")
    job = Job(
        steps=[[box.python, "attack_0.py"], [box.python, "attack_1.py"]],
        logs=["step0.log", "step1.log"],
        env={**confine.allowed_env(), "HOME": str(box.out), "AUTOLOOP_OUT": "{out}"},
        timeout_s=timeout,
        workdir=box.work,
        out_dir=box.out,
        sandbox={"net": False, "required": True},
        readable=(str(box.base),),
        read_only=("attack_1.py",),
        step_stdin=[None, "nonce-5678\n"],
        step_start_after=[None, READY_LINE],
    )
    return run_steps(job, box.work, box.out, {"CUDA_VISIBLE_DEVICES": ""}, cancel)


WAIT_FOR_EVALUATION = """
print({line!r}, flush=True)
deadline = time.time() + 30
while not os.path.exists("{out}/evaluation-started") and time.time() < deadline:
    time.sleep(0.02)
"""


@needs_bwrap
@pytest.mark.parametrize("when", ["held", "after its go"])
def test_a_cancel_ends_an_evaluation_started_early(box, when):
    """Ctrl-C (the job's cancel) while train.py runs and the evaluation waits for its go: both end, and the
    evaluation never gets its nonce; or once the evaluation got its go: it ends. Nothing of either lives on."""
    wait = WAIT_FOR_EVALUATION.format(line=READY_LINE, out=box.out)
    training = wait + ("time.sleep(3600)\n" if when == "held" else "")
    then = "" if when == "held" else f'open("{box.out}/evaluating", "w").close()\ntime.sleep(3600)\n'
    cancel = threading.Event()
    sign = box.out / ("evaluation-started" if when == "held" else "evaluating")

    def cancel_on_sign() -> None:
        deadline = time.monotonic() + 30
        while not sign.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        cancel.set()

    threading.Thread(target=cancel_on_sign, daemon=True).start()
    started = time.monotonic()
    result = held_evaluation(box, training, cancel=cancel, then=then)
    assert result.interrupted and time.monotonic() - started < 30, result
    assert sign.exists()
    if when == "held":
        assert len(result.steps) == 1 and "nonce-5678" not in (box.out / "step1.log").read_text()
    else:
        assert [s.exit_code for s in result.steps][0] == 0 and len(result.steps) == 2
    assert in_the_box(box) == []


@needs_bwrap
def test_a_held_evaluations_timeout_counts_from_its_go(box):
    """The hard timeout is per step: an evaluation that got ready early and waited for a long training step
    is timed from its go, not from its start."""
    training = WAIT_FOR_EVALUATION.format(line=READY_LINE, out=box.out) + "time.sleep(2.5)\n"
    result = held_evaluation(box, training, timeout=3.5, then="time.sleep(1.5)\n")
    assert [(s.exit_code, s.timed_out) for s in result.steps] == [(0, False), (0, False)], result


@needs_bwrap
@pytest.mark.parametrize("how", ["a link to a host file", "replaced while written"])
def test_the_controller_never_writes_through_a_log_the_run_planted(box, how):
    """A run's directory is the run's to write; its logs are the controller's, which writes them as root. Old: a
    train.py that left `eval.log` as a link to a host file had the controller truncate and fill that file; now
    the log is created anew (never followed), and one the run replaces while it is written is put back."""
    victim = box.base / "host-file"
    victim.write_text("the host's")
    if how == "a link to a host file":
        plant = f'os.symlink("{victim}", "{box.out}/step1.log")\n'
        training = plant + f"print({READY_LINE!r}, flush=True)\n"
        result = held_evaluation(box, training)
    else:
        training = WAIT_FOR_EVALUATION.format(line=READY_LINE, out=box.out) + (
            f'os.unlink("{box.out}/step1.log")\nopen("{box.out}/step1.log", "w").write("FORGED\\n")\n'
        )
        result = held_evaluation(box, training)
    assert [s.exit_code for s in result.steps] == [0, 0], result
    assert victim.read_text() == "the host's"
    log = box.out / "step1.log"
    assert not log.is_symlink() and "TOLD 'nonce-5678'" in log.read_text() and "FORGED" not in log.read_text()


# ---------------------------------------------------------------------------
# Where the machine allows less, and the devices a slot gets
# ---------------------------------------------------------------------------

FAKE_BWRAP = (
    '#!/bin/sh\nfor a in "$@"; do case "$a" in {refused}) echo "bwrap: no: $a" >&2; exit 1;; esac; done\n'
    'exec {bwrap} "$@"\n'
)


@needs_bwrap
@pytest.mark.parametrize(
    "refused, expected", [("--disable-userns", ("--unshare-user",)), ("--unshare-user", ()), ("--cap-drop", None)]
)
def test_the_probe_falls_back_without_a_user_namespace(our_box, monkeypatch, tmp_path, refused, expected):
    """A bubblewrap (or kernel) that cannot make a user namespace: the step keeps our uid, still without any
    capability and in its own namespaces; one that cannot even drop capabilities is no sandbox (the problem)."""
    box = our_box
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text(FAKE_BWRAP.format(refused=refused, bwrap=shutil.which("bwrap")))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(confine, "_PROBE", {})
    if expected is None:
        assert confine.sandbox_problem() == f"bubblewrap cannot run here (bwrap: no: {refused})"
        return
    assert confine.sandbox_problem() == "" and confine._PROBE["machine"]["userns"] == expected
    assert refused in confine.sandbox_note()
    argv = confine.sandboxed(["true"], [], False)
    assert argv[0] == str(fake) and refused not in argv and "ALL" in argv
    result = box.attack("""
line = next(l for l in open("/proc/self/status") if l.startswith("CapEff"))
attempt("capabilities", lambda: need(int(line.split()[1], 16)))
attempt("remount /", lambda: check(libc.mount(b"none", b"/", None, 32, None)))
attempt("our processes", lambda: need([p for p in os.listdir("/proc") if p.isdigit() and int(p) > 10]))
""")
    assert len(result["tried"]) == 3 and result["got"] == {}, result


def test_a_slot_gets_the_device_nodes_of_its_gpus(monkeypatch):
    nodes = ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2"]
    monkeypatch.setattr(confine, "_nvidia_nodes", lambda: nodes)
    shared, rocm = list(confine.NVIDIA_SHARED), list(confine.ROCM)
    assert confine.gpu_devices(None) == [*shared, *nodes, *rocm]  # unset: every GPU
    assert confine.gpu_devices("2") == [*shared, "/dev/nvidia2", *rocm]
    assert confine.gpu_devices("1,0") == [*shared, "/dev/nvidia1", "/dev/nvidia0", *rocm]
    assert confine.gpu_devices("0,-1,1") == [*shared, "/dev/nvidia0", *rocm]  # CUDA stops at the first invalid
    assert confine.gpu_devices("") == rocm and confine.gpu_devices("-1") == rocm  # a CPU slot: none
    assert confine.gpu_devices("GPU-8a9b3c") == [*shared, *nodes, *rocm]  # by UUID: every one (CUDA picks)
    argv = confine._command(confine.FULL, ["true"], [], False, [], [], [], confine.gpu_devices("1"))
    assert " ".join(argv).count("--dev-bind-try /dev/nvidia1 /dev/nvidia1") == 1
    assert "/dev/nvidia0" not in argv and argv.index("--dev") < argv.index("/dev/nvidia1")


# ---------------------------------------------------------------------------
# The same attacks in a train.py the loop runs
# ---------------------------------------------------------------------------

LOOP_ATTACK = string.Template("""
MS_REMOUNT = 32
attempt("remount /", lambda: check(libc.mount(b"none", b"/", None, MS_REMOUNT, None)))
attempt("plant a hook", lambda: open($hook, "w").write("#!/bin/sh\\ntouch pwned\\n"))
attempt("setns", lambda: check(libc.setns(os.open("/proc/1/ns/net", os.O_RDONLY), 0x40000000)))
attempt("loopback", lambda: socket.create_connection(("127.0.0.1", $port), 3).close())
attempt("the controller's environment", lambda: find("environ", $secret))
def connect(path):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
attempt("a host socket", lambda: connect($sock))
attempt("rewrite .git", lambda: open(".git", "w").write("gitdir: /elsewhere\\n"))
attempt("the host's /dev", lambda: need(set(os.listdir("/dev")) & {"kmsg", "mem", "loop0", "sda", "vda", "nvme0n1"}))
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        beat = "import sys, time\\nwhile True:\\n    open(sys.argv[1], 'a').write('.')\\n    time.sleep(0.05)"
        os.execv(sys.executable, [sys.executable, "-c", beat, os.path.abspath("heartbeat"), $marker])
    os._exit(0)
time.sleep(0.3)
print("ESCAPED" if got else "HELD", json.dumps(got), flush=True)
""")


def outside_the_masks(fallback: Path) -> Path:
    """A fresh directory in $HOME where the sandbox leaves it visible (not under /tmp, /run, ...), else fallback."""
    home = Path.home()
    if not os.access(home, os.W_OK) or any(str(home).startswith(m) for m in confine.MASKED):
        return fallback
    return Path(tempfile.mkdtemp(prefix=".autoloop-sandbox-test-", dir=home))


@needs_bwrap
@pytest.mark.timeout(300)
def test_a_train_py_that_attacks_from_the_loop_gets_nowhere(tmp_path, monkeypatch):
    """The loop as it runs (sandbox on): one edit tries every attack above and then reports honestly; its row is
    honest or a crash, its log says it managed nothing, and nothing outside its run changed."""
    from orchestrator.loop import Settings, run_loop
    from orchestrator.store.ledger import read_rows
    from orchestrator.store.session import Paths

    secret, marker = f"sk-{uuid.uuid4().hex}", f"autoloop-daemon-{uuid.uuid4().hex}"
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    project = outside_the_masks(tmp_path)  # like a real checkout: in the sandbox, read-only but there
    repo = project / "repo"
    make_repo(
        repo,
        {
            "train.py": fakes.ok(1.0),
            "prepare.py": "import os\nTIME_BUDGET = float(os.environ.get('AUTOLOOP_TIME_BUDGET', '300'))\n",
        },
    )
    hooks = sorted(p.name for p in (repo / ".git" / "hooks").iterdir())
    server = socket.create_server(("127.0.0.1", 0))
    host_dir = tmp_dir()
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(host_dir / "s.sock"))
    unix.listen()
    accepted = []

    def serve():
        try:
            accepted.append(server.accept())
        except OSError:  # closed at the end of the test
            pass

    threading.Thread(target=serve, daemon=True).start()
    witness = subprocess.Popen(["sleep", "600"], env={"PATH": os.environ["PATH"], "OPENAI_API_KEY": secret})
    values = {
        "hook": str(repo / ".git" / "hooks" / "post-checkout"),
        "port": server.getsockname()[1],
        "secret": secret,
        "sock": str(host_dir / "s.sock"),
        "marker": marker,
    }
    attack = PRELUDE + SPIES + LOOP_ATTACK.substitute({k: repr(v) for k, v in values.items()}) + DONE
    plan = fakes.write_plan(tmp_path / "plan.json", [{"description": "attacks", "train": attack + fakes.ok(0.9)}])
    monkeypatch.setenv("AUTOLOOP_TEST_PLAN", str(plan))
    try:
        run_loop(
            Settings(
                repo=repo,
                tag="a",
                budget=1.0,
                timeout=60.0,
                proposer="fakes:Scripted",
                baseline_repeats=0,
                max_experiments=2,
                sandbox="on",
            ),
            echo=lambda _: None,
        )
        rows = read_rows(Paths(repo, "a").ledger)
        log = (Paths(repo, "a").run_dir(2) / "run.log").read_text()
        assert [r.description.split(" [")[0] for r in rows] == ["baseline", "attacks"], rows
        assert rows[1].status == "crash" or (rows[1].status == "keep" and abs(rows[1].val_bpb - 0.9) < 1e-9), rows
        assert "HELD" in log and "ESCAPED" not in log, log
        assert len(outcome(log)["tried"]) == 8
        if project != tmp_path:  # (in HOME, once read-only; the sandbox holds neither HOME nor the repository now)
            assert "No such file or directory" in outcome(log)["errors"]["plant a hook"], log
        assert secret not in log and not accepted
        assert sorted(p.name for p in (repo / ".git" / "hooks").iterdir()) == hooks
        assert not list(repo.rglob("pwned"))
        gitfile = (Paths(repo, "a").slot(0) / ".git").read_text()
        assert gitfile.startswith("gitdir: ") and "/elsewhere" not in gitfile
        assert survivors(marker) == []
    finally:
        for proc in survivors(marker):
            proc.kill()
        witness.kill()
        witness.wait()
        server.close()
        unix.close()
        shutil.rmtree(host_dir, ignore_errors=True)
        if project != tmp_path:
            shutil.rmtree(project, ignore_errors=True)
