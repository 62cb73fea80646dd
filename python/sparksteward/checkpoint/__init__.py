"""Checkpoints of keyed state (FLIP-428): records, storage, fast duplication, restore, rescale and the
coordinator the driver agent hosts. Nothing here imports pyspark or ``agents/``.
"""
