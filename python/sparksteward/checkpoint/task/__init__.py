"""The task side of checkpoints: the executor agent's subtask service, the local file cache, the
snapshot uploader and the restore of one subtask (at the same or another parallelism). Runs in the
executor agent and its Python workers."""
