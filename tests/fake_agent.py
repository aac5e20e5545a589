#!/usr/bin/env python3
"""A fake coding-agent CLI: `fake_agent.py PROMPT_FILE`. What it does on its k-th call is read from the JSON
list in $AUTOLOOP_TEST_AGENT_PLAN: {"bpb": 0.9} edits train.py's BPB, "other": also writes another file, "timeout": sleeps,
"nodesc": writes no description file, "noop": changes nothing, "fail": exits 3, "code": train.py source."""

import json
import os
import re
import sys
import time
from pathlib import Path

prompt = Path(sys.argv[1]).read_text()
plan = json.loads(Path(os.environ["AUTOLOOP_TEST_AGENT_PLAN"]).read_text())
counter = Path(os.environ["AUTOLOOP_TEST_AGENT_PLAN"] + ".count")
k = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(k + 1))
Path(os.environ["AUTOLOOP_TEST_AGENT_PLAN"] + f".prompt{k}").write_text(prompt)
step = plan[min(k, len(plan) - 1)]
print(f"fake agent call {k}: {step}")
if step.get("timeout"):
    time.sleep(600)
if step.get("fail"):
    print("Error: the agent gave up", flush=True)
    sys.exit(3)
train = Path("train.py")
if "code" in step:
    train.write_text(step["code"])
elif "bpb" in step:
    train.write_text(re.sub(r"^BPB = .*$", f"BPB = {step['bpb']!r}  # [0.1, 10.0]", train.read_text(), flags=re.M))
if step.get("other"):
    Path("notes.txt").write_text("the agent also wrote this\n")
desc_file = re.search(r"to this\s+file: (\S+)", prompt).group(1)
if not step.get("nodesc"):
    Path(desc_file).write_text(step.get("desc", f"set BPB to {step.get('bpb')}") + "\n")
print(f"done: {step.get('desc', 'edited train.py')}")
