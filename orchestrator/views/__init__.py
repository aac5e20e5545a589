"""Read-only views of a session: `autoloop status` and `autoloop report`."""
