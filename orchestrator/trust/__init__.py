"""What keeps a run honest: the sandbox, redaction, the run's summary and evaluation, the harness, the guard."""
