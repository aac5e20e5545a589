"""The experiment logic under the loop: settings, the noise gate, state, planning, trials, judging, held-out
checks, the workspace."""
