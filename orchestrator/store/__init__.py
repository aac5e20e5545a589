"""Persistent state: the ledger, session paths and status files, spend, git, train.py's constants."""
