"""The serve stage (per call): validate, choose, fill, replay, narrow; thread-safe.

Order, and why (from the bottom up):
1. ``fills``: the fill rule of each input role; after a fill, a buffer holds the call's values and the role's
   padding, whatever it held before.
2. ``call_checks``: a call's inputs checked against the trace's contract before anything runs (a ``ValueError`` in
   the user's names), and its sizes read into a ``CallPlan``.
3. ``split``: a call over the largest budget cut at segment edges into calls that fit.
4. ``call_costs``: the replay and eager times measured per bucket at warm-up, for the per-call choice.
5. ``arguments``: the decorator's hot path reads a call's arguments into graph inputs with no dynamo guard.
6. ``runtime``: ``VGraphRuntime``, which serves each call from the smallest bucket that fits (or a split, or
   eagerly), holding one lock from fill to copy-out.
"""
