"""Checkpoints on disk or on an object store (remote.py): the sharded layout and manifest, writing without ever leaving a half-written folder,
sha256 verification, keep-N / major retention, finding the newest valid checkpoint and resuming from it
(also on another worker count). Used by the worker actors (each saves its shard) and by the trainer.
"""
