"""One process's training step: the schedule over the model's units (the only owner of CUDA streams and events),
its policies (ZeRO-3 gather-ahead and reduce-behind, host offload, weight-gradient and optimizer-update overlap,
CUDA-graph capture), the sharded AdamW and the loss-spike guard.

Collectives reach it through the ``Communicator`` interface (communicator.py), which the Ray actors implement;
the engine never imports Ray.
"""
