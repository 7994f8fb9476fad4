"""Parallelism applied to a model from outside it: data parallelism's sharded stores (``data``: ZeRO-2's
gradient shards and ZeRO-3's weight shards, policies over the model's units) and tensor parallelism (``tensor``:
how the weights split over a group; ``tensor_pieces``: the plan that replaces the model's pieces with ones that
add the group's collectives, including sequence parallelism over the token rows).

Sits between the model and the engine: it imports the model's layout and pieces, the engine imports it, and the
model imports nothing from here (it declares its units and pieces; the engine hands it these as policies).
"""
