"""LLM proposers end to end: a fake coding-agent CLI, and the real openai client against a local fake server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fakes
import pytest
from conftest import TESTS
from fake_openai import FakeOpenAI, edit

from orchestrator import LoopError
from orchestrator.loop import Settings, run_loop
from orchestrator.proposers.llm import EditError, apply_reply
from orchestrator.proposers.prompt import build_prompt
from orchestrator.store.ledger import Record, read_record, read_rows
from orchestrator.store.session import Paths

pytest.importorskip("openai")


def settings(repo, proposer, **kw):
    base = dict(repo=repo, tag="l", budget=1.0, timeout=20.0, proposer=proposer, baseline_repeats=0)
    base.update(kw)
    return Settings(**base)


def quiet(_line):
    pass


# ---------------------------------------------------------------------------
# agent
# ---------------------------------------------------------------------------


def test_agent_proposer_end_to_end(fake_repo, tmp_path, monkeypatch):
    repo = fake_repo(fakes.ok(1.0))
    plan = tmp_path / "agent-plan.json"
    crashing = fakes.crash()
    plan.write_text(
        json.dumps(
            [
                {"bpb": 0.9, "desc": "lower BPB to 0.9"},
                {"bpb": 0.8, "other": True, "desc": "also writes notes"},
                {"timeout": True},
                {"code": crashing, "desc": "a buggy rewrite"},
                {"bpb": 0.85, "nodesc": True},
                {"fail": True},
                {"noop": True, "desc": "nothing"},
            ]
        )
    )
    monkeypatch.setenv("AUTOLOOP_TEST_AGENT_PLAN", str(plan))
    options = {"agent_cmd": f"{sys.executable} {TESTS / 'fake_agent.py'} {{prompt_file}}", "agent_timeout": 3}
    run_loop(settings(repo, "agent", max_experiments=8, pipeline=False, options=options), echo=quiet)
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows] == ["keep", "keep", "crash", "crash", "crash", "keep", "crash", "crash"]
    assert rows[1].description == "lower BPB to 0.9" and rows[1].val_bpb == 0.9
    assert "edited files other than train.py: notes.txt" in rows[2].description
    assert "agent timed out after 3s" in rows[3].description
    assert rows[4].description.startswith("a buggy rewrite") and "CUDA out of memory (fake)" in rows[4].description
    assert rows[5].description == "done: edited train.py"  # no description file: its last line of output
    assert "agent exited with code 3: Error: the agent gave up" in rows[6].description
    assert "the agent did not change train.py" in rows[7].description
    # the prompt after the crash carries the crash's log tail; the agent's output is kept with the run
    prompt_after_crash = Path(f"{plan}.prompt4").read_text()
    assert "RuntimeError: CUDA out of memory (fake)" in prompt_after_crash and "crashed" in prompt_after_crash
    assert "# Current best train.py" in Path(f"{plan}.prompt0").read_text()
    assert "fake agent call 0" in (Paths(repo, "l").run_dir(2) / "proposer.log").read_text()
    assert not (repo / "notes.txt").exists()


def test_agent_missing_command_is_a_clear_error(fake_repo):
    repo = fake_repo(fakes.ok(1.0))
    with pytest.raises(LoopError, match="agent command 'no-such-agent-xyz' not found"):
        run_loop(settings(repo, "agent", options={"agent_cmd": "no-such-agent-xyz {prompt}"}), echo=quiet)


# ---------------------------------------------------------------------------
# llm
# ---------------------------------------------------------------------------

OLD = "BPB = 1.0  # [0.1, 10.0]"


def test_llm_proposer_end_to_end(fake_repo, monkeypatch):
    repo = fake_repo(fakes.ok(1.0))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    replies = [
        edit(OLD, "BPB = 0.9  # [0.1, 10.0]", "good edit"),  # 2 keep
        {"content": "I would lower the LR but I forgot the format"},  # 3 malformed ...
        edit("BPB = 0.9  # [0.1, 10.0]", "BPB = 0.8  # [0.1, 10.0]", "retried"),  #   ... fixed on retry: keep
        {"content": "no edit"},
        {"content": "still no edit"},  # 4 crash: did not apply
        edit("BPB = 0.8  # [0.1, 10.0]", "BPB = (", "breaks train.py"),  # 5 crash: does not compile
        edit("import time", "raise RuntimeError('boom from the edit')", "runtime bug"),  # 6 crash at run time
        {"status": 500},
        edit("BPB = 0.8  # [0.1, 10.0]", "BPB = 0.7  # [0.1, 10.0]", "after a 500"),  # 7 keep
        {"content": "x", "delay": 1.5} | edit("BPB = 0.7  # [0.1, 10.0]", "BPB = 0.75  # [0.1, 10.0]", "slow"),  # 8
        {"status": 500},  # 9.. persistent 500s
    ]
    with FakeOpenAI(replies) as server:
        options = {
            "llm_base_url": server.base_url,
            "llm_model": "fake-model",
            "llm_price_in": 1.0,
            "llm_price_out": 2.0,
        }
        run_loop(settings(repo, "llm", max_experiments=9, pipeline=False, options=options), echo=quiet)
        prompts = server.prompts()
    rows = read_rows(repo / "results.tsv")
    assert [r.status for r in rows] == ["keep", "keep", "keep", "crash", "crash", "crash", "keep", "discard", "crash"]
    assert [r.val_bpb for r in rows][:3] == [1.0, 0.9, 0.8]
    assert "LLM reply did not apply" in rows[3].description
    assert "does not compile" in rows[4].description
    assert "boom from the edit" in rows[5].description
    assert rows[6].description == "after a 500" and rows[7].description == "slow"
    assert "LLM API error" in rows[8].description
    assert "boom from the edit" in prompts[8]  # the run-time crash's log tail reached the next prompt
    assert "could not be applied" in prompts[2]  # the retry told the model what went wrong
    record = read_record(Paths(repo, "l").run_dir(3))
    assert record.info["usage"]["total_tokens"] == 240 and record.info["model"] == "fake-model"
    assert abs(record.info["usage"]["cost"] - (200 * 1.0 + 40 * 2.0) / 1e6) < 1e-12


def test_llm_token_budget_stops_the_loop(fake_repo):
    repo = fake_repo(fakes.ok(1.0))
    replies = [edit(OLD, f"BPB = {0.99 - i / 100}  # [0.1, 10.0]", f"step {i}") for i in range(6)]
    for i, r in enumerate(replies[1:], 1):
        r["content"] = r["content"].replace(OLD, f"BPB = {0.99 - (i - 1) / 100}  # [0.1, 10.0]")
    lines = []
    with FakeOpenAI(replies) as server:
        options = {"llm_base_url": server.base_url, "llm_model": "m"}
        run_loop(settings(repo, "llm", max_tokens=300, pipeline=False, options=options), echo=lines.append)
    assert len(read_rows(repo / "results.tsv")) == 4  # 120 tokens per idea: the third crosses 300
    assert "reached --max-tokens 300 (360 used)" in lines[-1]


def test_llm_missing_key_for_hosted_api_is_a_clear_error(fake_repo, monkeypatch):
    repo = fake_repo(fakes.ok(1.0))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(LoopError, match="set OPENAI_API_KEY"):
        run_loop(settings(repo, "llm", options={"llm_model": "gpt-x"}), echo=quiet)
    with pytest.raises(LoopError, match="--llm-model"):
        run_loop(settings(repo, "llm", options={}), echo=quiet)


def test_apply_reply_formats():
    src = "A = 1\nB = 2\nC = 3\n"
    new, desc = apply_reply(src, "DESCRIPTION: set B\n<<<<<<< SEARCH\nB = 2\n=======\nB = 5\n>>>>>>> REPLACE\n")
    assert new == "A = 1\nB = 5\nC = 3\n" and desc == "set B"
    new, _ = apply_reply(src, "<<<<<<< SEARCH\nB = 2   \n=======\nB = 6\n>>>>>>> REPLACE")  # trailing spaces
    assert new == "A = 1\nB = 6\nC = 3\n"
    whole, desc = apply_reply(src, "DESCRIPTION: rewrite\n```python\nA = 1\nB = 7\nC = 3\n```")
    assert whole == "A = 1\nB = 7\nC = 3\n" and desc == "rewrite"
    for bad in [
        "no blocks at all",
        "<<<<<<< SEARCH\nZ = 9\n=======\nZ = 1\n>>>>>>> REPLACE",
        "<<<<<<< SEARCH\nB = 2\n=======\nB = 2\n>>>>>>> REPLACE",
    ]:
        with pytest.raises(EditError):
            apply_reply(src, bad)
    with pytest.raises(EditError, match="matches 2 places"):
        apply_reply("X = 1\nX = 1\n", "<<<<<<< SEARCH\nX = 1\n=======\nX = 2\n>>>>>>> REPLACE")


def test_prompt_stays_bounded_with_500_rows(tmp_path):
    history = [
        Record(
            n=i,
            status=["keep", "discard", "crash"][i % 3],
            description=f"idea number {i} " + "x" * 200,
            val_bpb=None if i % 3 == 2 else 1.0 - i / 1e4,
        )
        for i in range(1, 501)
    ]
    program = "brief " * 2000
    prompt = build_prompt(
        program, "print('train')\n" * 200, history, Paths(tmp_path, "t"), "do one thing", max_chars=20_000
    )
    assert len(prompt) <= 20_000
    assert "print('train')" in prompt and "do one thing" in prompt and "#500" in prompt
    best = min((r for r in history if r.val_bpb is not None), key=lambda r: r.val_bpb)
    assert f"#{best.n} " in prompt  # the best row survives the cut


@pytest.mark.parametrize("pipeline", [True, False])
def test_pipelining_prepares_the_next_idea_while_training(fake_repo, pipeline):
    repo = fake_repo(fakes.ok(1.0, sleep=1.5))
    replies = [
        edit("BPB = 1.0  # [0.1, 10.0]", "BPB = 0.9  # [0.1, 10.0]", "first"),
        edit('print("step 00001 | loss: 1.0")', 'print("step 00001 | loss: 0.5")', "second, made on the old best"),
        edit('print("step 00001 | loss: 1.0")', 'print("step 00001 | loss: 0.4")', "third"),
    ]
    with FakeOpenAI(replies) as server:
        options = {"llm_base_url": server.base_url, "llm_model": "m"}
        run_loop(settings(repo, "llm", max_experiments=4, options=options, pipeline=pipeline), echo=quiet)
        asked = [t for t, _ in server.requests]
    paths = Paths(repo, "l")
    records = [read_record(paths.run_dir(n)) for n in range(1, 5)]
    rows = read_rows(repo / "results.tsv")
    assert [r.description for r in rows] == ["baseline", "first", "second, made on the old best", "third"]
    # experiment 2 trained from `submitted` (an epoch time) for timings["train"] seconds (1.5 s of it sleeping)
    train_start_2 = records[1].timings["submitted"]
    train_end_2 = train_start_2 + records[1].timings["train"]
    assert records[1].timings["train"] > 1.5
    if not pipeline:  # the idea for experiment 3 is asked for only once experiment 2 is done
        assert asked[1] > train_end_2 and records[2].timings["propose_wait"] > 0
        return
    # the idea for experiment 3 was requested while experiment 2 was still training, and was ready in time
    assert train_start_2 < asked[1] < train_end_2
    assert records[2].timings["propose_wait"] < 0.5
    # experiment 2 was kept; the prefetched idea was re-applied on top of it, so both edits are in #3
    assert records[1].status == "keep" and records[2].parent == records[1].commit
    diff = (paths.run_dir(3) / "diff.patch").read_text()
    assert '+print("step 00001 | loss: 0.5")' in diff and "-BPB" not in diff and "+BPB" not in diff
