"""Tier 2, block graphs: towers whose forward does host work, served with their glue run as written and their
block stack replayed from bucket graphs.

``block_program`` (which module list holds the blocks and where each block call's arguments come from, learned
from one eager forward: the tier's record), ``block_graphs`` (``CompiledBlockTower``, its runtime).
"""
