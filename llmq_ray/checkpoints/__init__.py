"""Checkpoints on disk or on an object store, one module per job; imports point one way, down this list:

* ``layout``: folder and file names, the manifest's schema (build, read, config check, data and FP8 scale state);
* ``remote``: object-store I/O (uploads, the manifest last, this node's mirror of a checkpoint);
* ``verify``: sizes, sha256, coverage; the newest valid checkpoint and ``--continue``'s target;
* ``local``: local-folder I/O (fsync, a tmp folder renamed into place) and reading any flat range back;
* ``retention``: keep-N and major checkpoints, setting aside an abandoned branch;
* ``resume``: the TrainEngine side (what a rank saves and restores; one-process saves).

Used by the worker actors (each saves its shard), the coordinator (manifest, publish, retention) and the trainer.
"""
