"""The driver side of checkpoints: the coordinator and its pending and completed checkpoints, the
registration of states, the deleter, the driver agent's ``state.*`` service and gateway, the report and
the stats. Runs in the driver agent only."""
