"""--tracker NAME: real sessions of the loop mirrored to a real MLflow server, to W&B's offline files and to
TensorBoard's event files, read back through MlflowClient, wandb's own record format and TensorBoard's own reader;
a tracker that is down warns once, nothing more; trackers are plugins, found by name or as module:Class."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import fakes
import git
import pytest
from click.testing import CliRunner

from orchestrator import LoopError
from orchestrator.cli import main
from orchestrator.core.settings import Settings
from orchestrator.loop import run_loop
from orchestrator.store.ledger import read_rows
from orchestrator.store.session import Paths
from orchestrator.trackers.base import Backend, Trackers, loss_curve
from orchestrator.trackers.mlflow import MLflow


def train(bpb: float, lr: float = 0.04) -> str:
    """A fake train.py with two constants and five progress lines whose loss is 4/step."""
    return (
        f'"""fake train.py"""\n# Hyperparameters\nBPB = {bpb!r}  # [0.1, 10.0]\nLR = {lr!r}  # [0.001, 1.0]\n\n'
        "for step in range(1, 6):\n"
        '    print(f"step {step:05d} ({20 * step:.1f}%) | loss: {4 / step:.6f} | dt: 10ms | tok/sec: 1,000")\n'
        + fakes.SUMMARY
    )


PLAN = [
    {"description": "LR up", "train": train(0.8, lr=0.08)},
    {"description": "worse", "train": train(0.9, lr=0.08)},
    {"description": "crashes", "train": fakes.crash()},
    {"description": "best", "train": train(0.7, lr=0.1)},
]


def run(repo: Path, experiments: int, *tracker: str):
    args = [
        "run",
        "--repo",
        str(repo),
        "--tag",
        "t1",
        "--budget",
        "1",
        "--timeout",
        "20",
        "--proposer",
        "fakes:Scripted",
        "--baseline-repeats",
        "0",
        "--max-experiments",
        str(experiments),
    ]
    for name in tracker:
        args += ["--tracker", name]
    return CliRunner().invoke(main, args, catch_exceptions=False)


@pytest.fixture(autouse=True)
def tracker_env(monkeypatch):
    """No telemetry, no login, and the mlflow settings the tracker sets in-process put back afterwards."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    for key in [
        *MLflow.ENV,
        "MLFLOW_TRACKING_URI",
        "MLFLOW_EXPERIMENT_NAME",
        "WANDB_PROJECT",
        "WANDB_API_KEY",
        "WANDB_DISABLE_WEAVE",
        "WANDB_SILENT",
        "TENSORBOARD_LOGDIR",
    ]:
        monkeypatch.setenv(key, "")  # remembers the value to restore ...
        monkeypatch.delenv(key)  # ... and leaves it unset for the test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (sqlite store, served artifacts) for the module, started first so that it
    boots (tens of seconds on a busy machine) while the other tests run; `mlflow_url` waits for it."""
    if importlib.util.find_spec("mlflow") is None:
        yield None
        return
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                f"sqlite:///{root / 'mlflow.db'}",
                "--artifacts-destination",
                str(root / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true"),
            start_new_session=True,
        )
    yield server, f"http://127.0.0.1:{port}", root / "server.log"
    os.killpg(server.pid, signal.SIGKILL)  # a test server: no graceful shutdown to wait for
    server.wait(timeout=30)


@pytest.fixture
def mlflow_url(mlflow_server) -> str:
    if mlflow_server is None:
        pytest.skip("mlflow is not installed")
    server, url, log = mlflow_server
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=1)
            return url
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)


def quiet(output: str) -> bool:
    """The loop's console and nothing else: its own lines, the table's rows and the progress lines."""
    return all(re.match(r"autoloop: |\s*#|\s*\d+\s", line) for line in output.splitlines())


def saved(repo: Path, tracker: str, store: str | None = None) -> dict:
    """A tracker's part of trackers.json for one store (the only one, or the one whose key starts with `store`)."""
    stores = json.loads((Paths(repo, "t1").state / "trackers.json").read_text())[tracker]["stores"]
    keys = [k for k in stores if store is None or k.startswith(store)]
    assert len(keys) == 1, stores
    return stores[keys[0]]


def children_of(client, experiment_id: str, parent: str) -> dict[int, object]:
    runs = client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    by_n = {int(r.data.tags["n"]): r for r in runs}
    assert len(by_n) == len(runs), "an experiment was logged twice"
    return by_n


def test_a_tracker_that_is_down_warns_once_and_the_loop_goes_on(fake_repo, plan, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    repo = fake_repo(train(1.0))
    plan(PLAN)
    t = time.monotonic()
    result = run(repo, 3, "mlflow")
    warnings = [line for line in result.output.splitlines() if "warning" in line]
    assert result.exit_code == 0 and len(warnings) == 1, result.output
    assert "--tracker mlflow is off" in warnings[0] and "cannot reach http://127.0.0.1:" in warnings[0]
    assert "MLFLOW_TRACKING_URI" in warnings[0]  # the fix
    assert "Traceback" not in result.output and len(read_rows(repo / "results.tsv")) == 3
    assert time.monotonic() - t < 60

    # as the warning promises: the same command, with a tracker that works, logs what it missed
    monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the default store in .autoloop/
    again = run(repo, 3, "mlflow")
    assert again.exit_code == 0 and "warning" not in again.output and quiet(again.output), again.output
    store = mlflow.MlflowClient(f"sqlite:///{repo / '.autoloop' / 'mlflow.db'}")
    parent = saved(repo, "mlflow")["parent"]
    experiment = store.get_experiment_by_name("autoloop-repo").experiment_id
    assert sorted(children_of(store, experiment, parent)) == [1, 2, 3]


def wandb_records(path: str):
    """The records of a .wandb file (W&B's protobuf Records in a LevelDB-style log: 32 KiB blocks, each record a
    7-byte header of crc32, length and type, FULL or split FIRST..LAST), which wandb writes but no longer reads."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunk, pos = chunk + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_run(path: str) -> dict:
    """What one offline run holds: its run record, config, history rows, summary and exit code."""
    out = {"history": [], "summary": {}, "config": {}, "dir": Path(path).parent}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["run"] = record.run
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "history":
            items = record.history.item
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
        elif kind == "summary":
            out["summary"].update({i.key: json.loads(i.value_json) for i in record.summary.update if i.key})
        elif kind == "exit":
            out["exit"] = record.exit.exit_code
    return out


def test_wandb_offline_and_mlflow_default_store_together(fake_repo, plan, monkeypatch, tmp_path):
    """W&B offline: a run per experiment in the session's group, read back from its files; and MLflow with no
    MLFLOW_TRACKING_URI: a store in .autoloop/, nothing written into the repo."""
    pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    import openai  # noqa: F401 - as with --proposer llm: wandb then suggests Weave on the console, unless told not to

    for key in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(key, str(tmp_path / "wb" / key.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    repo = fake_repo(train(1.0))
    plan(PLAN)
    first = run(repo, 4, "wandb", "mlflow")
    assert first.exit_code == 0 and "warning" not in first.output and quiet(first.output), first.output

    session_id = saved(repo, "wandb")["session"]
    offline = str(tmp_path / "wb" / "wandb_dir" / "wandb" / "offline-run-*" / "*.wandb")
    runs = [wandb_run(p) for p in sorted(glob.glob(offline))]
    by_id = {r["run"].run_id: r for r in runs}
    assert sorted(by_id) == sorted([session_id] + [f"{session_id}-{n}" for n in range(1, 5)])
    assert all(r["run"].run_group == "t1" and r["run"].project == "autoloop-repo" for r in runs)
    lr_up = by_id[f"{session_id}-2"]
    assert lr_up["run"].job_type == "experiment" and lr_up["run"].display_name == "2: LR up"
    assert (lr_up["config"]["BPB"], lr_up["config"]["LR"], lr_up["config"]["changed"]) == (0.8, 0.08, ["BPB", "LR"])
    assert [(h["_step"], h["train_loss"]) for h in lr_up["history"]] == [(s, round(4 / s, 6)) for s in range(1, 6)]
    assert lr_up["summary"]["val_bpb"] == 0.8 and lr_up["summary"]["status"] == "keep"
    assert lr_up["summary"]["memory_gb"] == 2.0 and lr_up["exit"] == 0
    assert "+BPB = 0.8" in (lr_up["dir"] / "files" / "train.py.diff").read_text()
    assert not (by_id[f"{session_id}-1"]["dir"] / "files" / "train.py.diff").exists()  # the baseline changed nothing
    assert by_id[f"{session_id}-4"]["exit"] == 1 and by_id[f"{session_id}-4"]["summary"]["status"] == "crash"
    session = by_id[session_id]
    assert session["run"].job_type == "session" and session["config"]["budget"] == 1.0
    assert [(h["_step"], h["best_val_bpb"]) for h in session["history"] if "best_val_bpb" in h] == [
        (1, 1.0),
        (2, 0.8),
        (3, 0.8),
        (4, 0.8),
    ]
    assert session["summary"]["stop"] == "reached --max-experiments 4" and session["summary"]["keep"] == 2
    files = session["dir"] / "files"
    assert (files / "report.md").exists() and list(files.glob("media/images/progress_*.png"))
    assert list(files.glob("media/table/experiments_*.table.json"))

    store = mlflow.MlflowClient(f"sqlite:///{repo / '.autoloop' / 'mlflow.db'}")
    experiment = store.get_experiment_by_name("autoloop-repo")
    assert experiment.artifact_location == (repo / ".autoloop" / "mlartifacts").as_uri()
    parent = saved(repo, "mlflow")["parent"]
    assert sorted(children_of(store, experiment.experiment_id, parent)) == [1, 2, 3, 4]
    assert git.Repo(repo).git.status("--porcelain", "--ignored=no") == ""  # the repo's root stays clean

    second = run(repo, 5, "wandb")
    assert second.exit_code == 0 and "warning" not in second.output and quiet(second.output), second.output
    ids = [wandb_run(p)["run"].run_id for p in sorted(glob.glob(offline))]
    assert sorted(ids) == sorted([session_id] * 2 + [f"{session_id}-{n}" for n in range(1, 6)])  # resumed, not redone


def test_loss_curve_reads_train_py_progress_lines(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        "schedule: 40 steps\nstep 00001 (2.5%) | loss: 10.834000 | dt: 90ms | tok/sec: 5,000 | mfu: 1.0%\n"
        "step 00002 (5.0%) | loss: nan | dt: 90ms\nnote: step 3 loss: 1\nstep 00003 (7.5%) | loss: 9.5\n"
    )
    assert loss_curve(log) == [(1, 10.834), (3, 9.5)] and loss_curve(tmp_path / "missing.log") == []


def test_mlflow_session_is_a_parent_run_with_a_child_run_per_experiment_and_resumes(
    fake_repo, plan, monkeypatch, mlflow_url, tmp_path
):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_url)
    repo = fake_repo(train(1.0))
    plan(PLAN)
    first = run(repo, 4, "mlflow")
    assert first.exit_code == 0 and "warning" not in first.output and quiet(first.output), first.output

    client = MlflowClient(mlflow_url)
    experiment = client.get_experiment_by_name("autoloop-repo")
    parent = saved(repo, "mlflow")["parent"]
    children = children_of(client, experiment.experiment_id, parent)
    assert sorted(children) == [1, 2, 3, 4]
    runs = {n: client.get_run(children[n].info.run_id) for n in children}
    lr_up = runs[2]
    assert lr_up.info.run_name == "2: LR up" and lr_up.info.status == "FINISHED"
    assert lr_up.data.params == {"BPB": "0.8", "LR": "0.08"}
    assert lr_up.data.tags["changed"] == "BPB, LR" and "changed" not in runs[1].data.tags  # the baseline
    assert (lr_up.data.tags["status"], lr_up.data.tags["decision"]) == ("keep", "keep")
    assert lr_up.data.tags["description"] == "LR up" and len(lr_up.data.tags["commit"]) == 40
    assert lr_up.data.metrics["val_bpb"] == 0.8 and lr_up.data.metrics["mfu_percent"] == 1.5
    assert lr_up.data.metrics["memory_gb"] == 2.0 and lr_up.data.metrics["tokens_per_s"] == 1e6
    assert lr_up.data.metrics["wall_seconds"] > 0 and "seconds_train" in lr_up.data.metrics
    curve = client.get_metric_history(lr_up.info.run_id, "train_loss")
    assert sorted((m.step, m.value) for m in curve) == [(s, round(4 / s, 6)) for s in range(1, 6)]
    diff = Path(client.download_artifacts(lr_up.info.run_id, "train.py.diff", str(tmp_path))).read_text()
    assert "-BPB = 1.0" in diff and "+BPB = 0.8" in diff and "+LR = 0.08" in diff
    assert client.list_artifacts(runs[1].info.run_id) == []  # the baseline changed nothing
    assert runs[3].data.tags["status"] == "discard"
    crashed = runs[4]
    assert crashed.info.status == "FAILED" and crashed.data.tags["status"] == "crash"
    assert "out of memory" in crashed.data.tags["reason"] and crashed.data.tags["phase"] == "train"
    assert crashed.data.params == {}  # its train.py has no constants

    session = client.get_run(parent)
    assert session.info.run_name == "t1" and session.info.status == "FINISHED"
    assert session.data.params["budget"] == "1.0" and "start_commit" in session.data.params
    assert session.data.tags["stop"] == "reached --max-experiments 4"
    assert [session.data.tags[k] for k in ("experiments", "keep", "discard", "crash")] == ["4", "2", "1", "1"]
    best = client.get_metric_history(parent, "best_val_bpb")
    assert sorted((m.step, m.value) for m in best) == [(1, 1.0), (2, 0.8), (3, 0.8), (4, 0.8)]
    assert {a.path for a in client.list_artifacts(parent)} == {"progress.png", "report.md"}

    # the controller killed while logging experiment 5: a half-logged child run that the resume replaces
    client.create_run(experiment.experiment_id, run_name="5: half", tags={"mlflow.parentRunId": parent, "n": "5"})
    second = run(repo, 5, "mlflow")
    assert second.exit_code == 0 and "warning" not in second.output and quiet(second.output), second.output
    assert saved(repo, "mlflow")["parent"] == parent
    children = children_of(client, experiment.experiment_id, parent)
    assert sorted(children) == [1, 2, 3, 4, 5] and children[5].info.run_name == "5: best"
    assert children[5].data.tags["changed"] == "BPB, LR"  # against its parent, the best (experiment 2)
    parents = client.search_runs([experiment.experiment_id], "tags.mlflow.runName = 't1'")
    assert [r.info.run_id for r in parents] == [parent]
    best = client.get_metric_history(parent, "best_val_bpb")
    assert sorted((m.step, m.value) for m in best)[-1] == (5, 0.7)

    # a morning's terminal without MLFLOW_TRACKING_URI, then the server again: each store holds the session
    # once (the local one catches up on all of it, the server on what it missed); nothing is logged twice
    plan(
        PLAN
        + [
            {"description": "six", "train": train(0.75, lr=0.12)},
            {"description": "seven", "train": train(0.72, lr=0.11)},
        ]
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    local = run(repo, 6, "mlflow")
    assert local.exit_code == 0 and "warning" not in local.output, local.output
    assert "--tracker mlflow now logs to sqlite:///" in local.output and mlflow_url in local.output
    store = MlflowClient(f"sqlite:///{repo / '.autoloop' / 'mlflow.db'}")
    on_disk = store.get_experiment_by_name("autoloop-repo").experiment_id
    assert sorted(children_of(store, on_disk, saved(repo, "mlflow", "sqlite")["parent"])) == [1, 2, 3, 4, 5, 6]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_url)
    back = run(repo, 7, "mlflow")
    assert back.exit_code == 0 and "warning" not in back.output, back.output
    assert saved(repo, "mlflow", mlflow_url)["parent"] == parent
    assert sorted(children_of(client, experiment.experiment_id, parent)) == [1, 2, 3, 4, 5, 6, 7]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id], "tags.mlflow.runName = 't1'")] == [
        parent
    ]


def session(repo: Path, experiments: int, *trackers: str) -> list[str]:
    """`run` in-process (any registered tracker name, or module:Class); the console's lines."""
    lines: list[str] = []
    run_loop(
        Settings(
            repo=repo,
            tag="t1",
            budget=1.0,
            timeout=20.0,
            proposer="fakes:Scripted",
            baseline_repeats=0,
            max_experiments=experiments,
            trackers=trackers,
        ),
        echo=lines.append,
    )
    return lines


def events(logdir: Path):
    """A TensorBoard run as TensorBoard reads it (every event file of the directory, restarts purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    return accumulator.Reload()


def scalars(run, tag: str) -> list[tuple[int, float]]:
    return [(e.step, pytest.approx(e.value, rel=1e-6)) for e in run.Scalars(tag)]  # stored as float32


def test_tensorboard_session_is_a_run_with_a_step_per_experiment_and_resumes(fake_repo, plan, monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.hparams import api_pb2, metadata
    from tensorboard.util import tensor_util
    from torch.utils.tensorboard import SummaryWriter

    repo = fake_repo(train(1.0))
    plan(PLAN + [{"description": "six", "train": train(0.75, lr=0.12)}])
    first = session(repo, 4, "tensorboard")
    assert not [line for line in first if "warning" in line], first
    logdir = repo / ".autoloop" / "tensorboard" / "t1"
    run = events(logdir)
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows] == ["keep", "keep", "discard", "crash"]
    assert scalars(run, "val_bpb") == [(n, r.val_bpb) for n, r in enumerate(rows, 1) if r.status != "crash"]
    assert scalars(run, "best_val_bpb") == [(1, 1.0), (2, 0.8), (3, 0.8), (4, 0.8)]
    assert scalars(run, "metrics/memory_gb")[1] == (2, 2.0) and scalars(run, "metrics/mfu_percent")[1] == (2, 1.5)
    assert [step for step, _ in scalars(run, "metrics/wall_seconds")] == [1, 2, 3, 4]  # the crash's too
    note = tensor_util.make_ndarray(run.Tensors("experiment/text_summary")[1].tensor_proto)[0].decode()
    assert note.startswith("**2: LR up**") and "+BPB = 0.8" in note and "LR = 0.08" in note
    assert [(i.step, i.width > 0) for i in run.Images("progress")] == [(4, True)]

    # the HParams tab: the session's pinned settings and its metric, the final best (the last best_val_bpb)
    hparams = run.PluginTagToContent(metadata.PLUGIN_NAME)
    experiment = metadata.parse_experiment_plugin_data(hparams[metadata.EXPERIMENT_TAG])
    assert [m.name.tag for m in experiment.metric_infos] == ["best_val_bpb"]
    assert {h.name for h in experiment.hparam_infos} >= {"budget", "seed", "gate", "tag", "start_commit"}
    started = metadata.parse_session_start_info_plugin_data(hparams[metadata.SESSION_START_INFO_TAG]).hparams
    assert (started["budget"].number_value, started["seed"].number_value, started["tag"].string_value) == (
        1.0,
        42.0,
        "t1",
    )
    ended = metadata.parse_session_end_info_plugin_data(hparams[metadata.SESSION_END_INFO_TAG])
    assert ended.status == api_pb2.STATUS_SUCCESS
    assert git.Repo(repo).git.status("--porcelain", "--ignored=no") == ""  # the repo's root stays clean

    # the controller killed while logging experiment 5 (written, not yet in trackers.json): the resume hides it
    with SummaryWriter(str(logdir)) as half:
        half.add_scalar("val_bpb", 123.0, 5)
    second = session(repo, 5, "tensorboard")
    assert not [line for line in second if "warning" in line], second
    run = events(logdir)
    rows = read_rows(repo / "results.tsv")
    assert scalars(run, "val_bpb") == [(1, 1.0), (2, 0.8), (3, 0.9), (5, rows[4].val_bpb)] and rows[4].val_bpb == 0.7
    assert scalars(run, "best_val_bpb")[-2:] == [(4, 0.8), (5, 0.7)]
    assert saved(repo, "tensorboard")["logged"] == [1, 2, 3, 4, 5]

    # TENSORBOARD_LOGDIR: the session is a run named by its tag there, logged whole (once), and said so
    monkeypatch.setenv("TENSORBOARD_LOGDIR", str(tmp_path / "tb"))
    third = session(repo, 6, "tensorboard")
    assert any("--tracker tensorboard now logs to" in line for line in third), third
    assert [step for step, _ in scalars(events(tmp_path / "tb" / "t1"), "best_val_bpb")] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in scalars(events(logdir), "best_val_bpb")] == [1, 2, 3, 4, 5]
    shutil.rmtree(tmp_path / "tb")  # a run directory deleted: the next resume logs the session there again
    session(repo, 6, "tensorboard")
    again = events(tmp_path / "tb" / "t1")
    assert [step for step, _ in scalars(again, "best_val_bpb")] == [1, 2, 3, 4, 5, 6]
    assert metadata.SESSION_START_INFO_TAG in again.PluginTagToContent(metadata.PLUGIN_NAME)


class Recorder(Backend):
    """A third-party tracker, named by module:Class: what it was given."""

    calls: list = []

    def open(self, state):
        Recorder.calls.append(("open", self.name))

    def log(self, experiment, state):
        Recorder.calls.append(("log", experiment.n, state.best_bpb))

    def close(self, state, stop, files):
        Recorder.calls.append(("close", stop, sorted(p.name for p in files)))


def test_trackers_are_plugins_and_a_missing_library_warns_with_the_pip_command(fake_repo, plan, monkeypatch):
    with pytest.raises(
        LoopError,
        match=r"unknown tracker 'nope'; available: mlflow, tensorboard, wandb .*"
        r"autoloop\.trackers",
    ):
        Trackers(("nope",), None, print)
    with pytest.raises(LoopError, match="not a subclass of orchestrator.trackers.base.Backend"):
        Trackers(("fakes:Scripted",), None, print)

    monkeypatch.setattr(Recorder, "calls", [])
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as without the tensorboard package
    repo = fake_repo(train(1.0))
    plan(PLAN)
    lines = session(repo, 2, f"{__name__}:Recorder", "tensorboard")
    warnings = [line for line in lines if "warning" in line]
    assert warnings == [
        "autoloop: warning: --tracker tensorboard is off for this run (starting: the tensorboard "
        "package is not installed (torch.utils.tensorboard needs it)); pip install "
        '"autoloop-ml[tensorboard]"'
    ], lines
    assert Recorder.calls == [
        ("open", f"{__name__}:Recorder"),
        ("log", 1, 1.0),
        ("log", 2, 0.8),
        ("close", "reached --max-experiments 2", ["progress.png", "report.md"]),
    ]
    assert len(read_rows(repo / "results.tsv")) == 2
