"""FLIP-76 unaligned checkpoints in micro-batches: the task's cut, the coordinator's record of cuts, the
deferred input (channel state) and the backlog it is replayed from."""
