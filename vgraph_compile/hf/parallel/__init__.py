"""The whole-tower graph over a ``torch.distributed`` process group: a share of the items per rank (data), a slice
of one large item's rows per rank (sequence), or both per call (``auto``).

``parallel_plan`` (which items go which way: a pure function of the grid), ``data_parallel`` and
``sequence_parallel`` (each mode), ``rank_agreement`` (what the ranks agree on before each collective step),
``parallel_tower`` (the modes per call), ``parallel_error`` (the error against one rank, and its bound).
"""
