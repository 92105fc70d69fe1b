"""certify: the request, the plan of every task, the run, and its executors (GPU workers, in process)."""
