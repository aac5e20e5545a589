from orchestrator.trust.summary import last_error_line, parse_summary, val_bpb_of

LOG = """step 1 | loss 3.0
---
val_bpb: 0.5
step 2
---
val_bpb:          0.997900
training_seconds: 300.1
peak_vram_mb:     45060.2
num_steps:        953
device:           cuda
"""


def test_only_the_final_block_counts():
    m = parse_summary(LOG)
    assert m["val_bpb"] == 0.9979 and m["num_steps"] == 953 and m["device"] == "cuda"
    assert isinstance(m["num_steps"], int) and isinstance(m["peak_vram_mb"], float)


def test_no_block_and_non_finite_values():
    assert parse_summary("no summary here\n") == {}
    assert val_bpb_of(parse_summary("---\nval_bpb: nan\n")) is None
    assert val_bpb_of(parse_summary("---\nval_bpb: inf\n")) is None
    assert val_bpb_of(parse_summary("---\nval_bpb: oops\n")) is None
    assert val_bpb_of(parse_summary("---\nval_bpb: 1.25\n")) == 1.25


def test_last_error_line_prefers_the_exception():
    log = 'step 1\nTraceback (most recent call last):\n  File "train.py", line 3\nRuntimeError: CUDA out of memory\n'
    assert last_error_line(log) == "RuntimeError: CUDA out of memory"
    assert last_error_line("just output\nlast words\n") == "last words"
    assert last_error_line("") == ""


def test_logs_are_read_from_the_tail(tmp_path):
    """A run that prints megabytes is measured from the end of its log, without reading it all."""
    from orchestrator.trust.summary import read_tail

    log = tmp_path / "run.log"
    block = "---\nval_bpb:          1.234567\ntraining_seconds: 1.0\n"
    log.write_bytes(b"x" * 5_000_000 + b"\n" + block.encode())
    text = read_tail(log, limit=1 << 20)
    assert len(text) <= 1 << 20 and text.endswith(block)
    assert parse_summary(text)["val_bpb"] == 1.234567
    assert read_tail(tmp_path / "missing.log") == ""
