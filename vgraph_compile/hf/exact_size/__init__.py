"""Tier 3, the tier of last resort: towers whose blocks themselves change shape with the items, served by their
forward compiled at each call's exact sizes, or by the stock tower where that measured slower
(``exact_size_tower``: ``CompiledExactSizeTower``; its record, the call signatures it measured).
"""
