"""The benchmark: tasks, protocol, runner and report."""
