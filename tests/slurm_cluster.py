"""A real one-node Slurm cluster on this machine, for the tests of the Slurm executor: slurmctld and slurmd as
child processes, with their configuration, state, spool, logs and ports their own (a temporary folder, free
ports chosen at start), so that two of them (CI's and a developer's run, say) never meet.

No munge and no slurmdbd: auth/none and cred/none, no accounting (so no `sacct`: jobs are watched with squeue
and `scontrol show job`; a finished job stays listed for MinJobAge, 5 minutes). Built for Slurm 22.05 (Debian
12's), run as root.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path
from types import TracebackType

import psutil

PACKAGES = "slurmctld slurmd slurm-client"
INSTALL = f"apt-get install -y --no-install-recommends {PACKAGES}"
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")
DAEMONS = ("slurmctld", "slurmd")
SBIN = os.pathsep.join(["/usr/sbin", "/usr/local/sbin", "/sbin"])  # the daemons, off a user's PATH
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING"}
CLIENT_PREFIXES = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_", "SCONTROL_", "SCANCEL_")


def binary(name: str) -> str | None:
    """Where the Slurm program `name` is: on PATH, or in an sbin folder (the daemons)."""
    return shutil.which(name) or shutil.which(name, path=SBIN)


def slurm_problem() -> str | None:
    """Why a Slurm cluster cannot start here, or None."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if binary(name) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): run `{INSTALL}`"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs as root (SlurmUser=root; slurmd starts the jobs)"
    return None


def free_port() -> int:
    """A TCP port that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a log, or a line saying there is none."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path.name}: none)"
    return "\n".join([f"--- {path.name} (last {lines} lines) ---", *text[-lines:]])


class SlurmError(RuntimeError):
    """A Slurm command failed, or the cluster did not come up."""


class SlurmCluster:
    """One node (this host, `cpus` CPUs: os.cpu_count() unless given) in one partition, `cpu`; one-CPU jobs share
    the node (select/cons_tres, CR_CPU). Client commands need `env` (SLURM_CONF, and none of the caller's
    SLURM_*/SBATCH_* variables); `run` runs one with it."""

    partition = "cpu"

    def __init__(self, root: Path, cpus: int | None = None, gpus: int = 0) -> None:
        self.root = Path(root).resolve()
        self.cpus = cpus or os.cpu_count() or 1
        self.gpus = gpus  # fake GPUs: device files Slurm allocates like GPUs (CUDA_VISIBLE_DEVICES set per job)
        self.node = socket.gethostname().split(".")[0]  # slurmctld runs only on a host SlurmctldHost names
        self.conf = self.root / "slurm.conf"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(CLIENT_PREFIXES)}
        self.env["SLURM_CONF"] = str(self.conf)
        self._daemons: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def config(self, ctld_port: int, slurmd_port: int) -> str:
        """slurm.conf: everything in `root`, the given ports."""
        r = self.root
        return f"""\
ClusterName=autoloop
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={r}/jobcomp.txt
# a node set DOWN by hand stays down until RESUME (2 would bring it back at slurmd's next registration)
ReturnToService=1
JobRequeue=0
MinJobAge=300
KillWait=5
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
# pending jobs are looked at every second, not every minute (a RESUMEd node is used at once)
SchedulerParameters=sched_interval=1,bf_interval=1
# CPUs as configured, whatever the hardware (else a node with more than it has is INVAL)
SlurmdParameters=config_overrides
{"GresTypes=gpu" if self.gpus else ""}
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} {f"Gres=gpu:{self.gpus} " if self.gpus else ""}\
RealMemory=1000 State=UNKNOWN
PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""

    def fake_gpus(self) -> None:
        """`gpus` character devices with NVIDIA's major number (files of no driver: nothing opens them) and a
        gres.conf naming them: Slurm hands them out as GPUs and sets each job's CUDA_VISIBLE_DEVICES (it needs a
        device's minor number for that, so plain files would not do). SlurmError where devices cannot be made."""
        for i in range(self.gpus):
            try:
                os.mknod(self.root / f"gpu{i}", 0o600 | stat.S_IFCHR, os.makedev(195, i))
            except OSError as e:
                raise SlurmError(f"fake GPU devices cannot be made here ({e.strerror}): root is needed") from None
        files = f"{self.root}/gpu[0-{self.gpus - 1}]" if self.gpus > 1 else f"{self.root}/gpu0"
        (self.root / "gres.conf").write_text(f"AutoDetect=off\nNodeName={self.node} Name=gpu File={files}\n")

    def start(self, timeout: float = 60.0) -> None:
        """Write the configuration, start slurmctld and slurmd, and wait until the node is idle."""
        if problem := slurm_problem():
            raise SlurmError(problem)
        for folder in ("state", "spool"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        if len(str(self.root / "spool")) > 80:  # slurmstepd's sockets there: unix socket paths hold 107 bytes
            raise SlurmError(f"{self.root} is too long a path for a Slurm cluster's spool (sockets in it)")
        ctld_port = free_port()
        slurmd_port = free_port()
        while slurmd_port == ctld_port:
            slurmd_port = free_port()
        self.conf.write_text(self.config(ctld_port, slurmd_port))
        if self.gpus:
            self.fake_gpus()
        commands = {
            "slurmctld": [str(binary("slurmctld")), "-D", "-i", "-f", str(self.conf)],
            "slurmd": [str(binary("slurmd")), "-D", "-N", self.node, "-f", str(self.conf)],
        }
        try:
            for name, command in commands.items():
                with open(self.root / f"{name}.out", "wb") as out:
                    self._daemons[name] = subprocess.Popen(
                        command,
                        env=self.env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # not a Ctrl-C's: the tests get it, and stop() ends the cluster
                    )
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for name, proc in self._daemons.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited ({proc.returncode}) at start\n{self.logs()}")
            try:
                proc = self.run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False, timeout=5)
                state = proc.stdout.strip() or proc.stderr.strip()
            except subprocess.TimeoutExpired:
                state = "sinfo timed out"
            if state == "idle":
                return
            time.sleep(0.2)
        raise SlurmError(f"the Slurm node is not idle after {timeout:.0f} s ({state})\n{self.logs()}")

    def logs(self) -> str:
        """The tails of the daemons' logs (their output, in the foreground: the log file and the errors
        before it opens)."""
        return "\n".join(tail(self.root / f"{name}.out") for name in DAEMONS)

    def run(self, *args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """The Slurm client command `args` (sbatch, squeue, scontrol, ...) on this cluster; output as text.
        check: a non-zero exit raises SlurmError, with the command's output."""
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(args)}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}")
        return proc

    def jobs(self) -> list[dict[str, str]]:
        """Every job the controller still lists (finished ones for MinJobAge): id, state (RUNNING, PENDING,
        CANCELLED, ...), reason (why pending: None once it runs) and name."""
        out = self.run("squeue", "-h", "-t", "all", "-o", "%i|%T|%r|%j").stdout
        keys = ("id", "state", "reason", "name")
        return [dict(zip(keys, line.split("|", 3))) for line in out.splitlines() if line.strip()]

    def set_node(self, state: str, reason: str = "test") -> None:
        """scontrol's node state: DOWN (its running jobs end as NODE_FAIL; new ones pend), DRAIN, RESUME."""
        args = ["scontrol", "update", f"NodeName={self.node}", f"State={state}"]
        if state.upper() != "RESUME":
            args.append(f"Reason={reason}")
        self.run(*args)

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes: its daemons and job steps (slurm* processes with one of its logs open; the
        environment is no sign, slurmstepd writes its title over it) and everything under them (the jobs)."""
        logs = {str(self.root / name) for name in ("slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log")}
        found: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["name"]):
            try:
                if (proc.info["name"] or "").startswith("slurm") and logs & {f.path for f in proc.open_files()}:
                    for p in [proc, *proc.children(recursive=True)]:
                        found[p.pid] = p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return list(found.values())

    def stop(self) -> None:
        """Cancel every job, shut the daemons down, and kill whatever of the cluster is left (a job step or a job
        that outlived them): no process of it outlives this. Safe to call twice, or after a failed start."""
        up = bool(self._daemons) and all(proc.poll() is None for proc in self._daemons.values())
        if up:
            try:
                self._cancel_all()
            except (SlurmError, subprocess.TimeoutExpired):
                pass  # killed below
        seen = self.processes()  # job steps ending on their own: waited for below, with what is left
        shut = False
        if up:
            try:
                shut = self.run("scontrol", "shutdown", check=False, timeout=10).returncode == 0
            except subprocess.TimeoutExpired:
                pass
        if not shut:  # a daemon down already, or the controller not answering: each its own SIGTERM
            for proc in self._daemons.values():
                if proc.poll() is None:
                    proc.terminate()
        for proc in self._daemons.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons.clear()
        left = self.processes()
        for proc in left:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs([*seen, *left], timeout=10)  # orphans (the steps): gone once init reaps them

    def _cancel_all(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            active = [job["id"] for job in self.jobs() if job["state"] in ACTIVE]
            if not active:
                return
            self.run("scancel", *active, check=False)
            time.sleep(0.2)
