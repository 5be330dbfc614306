"""What vgraph learns about a packed tower before any tier serves it, shared by every tier.

``packed_tower`` (its arguments, pixel row layout, geometry and outputs, from the tower), ``shrunk_tower`` (the
small tower of its own class it probes), ``tower_interfaces`` (the learned interface saved for a later process),
``metadata_plan`` and ``grid_metadata`` (the grid-derived keywords, computed on the host once per grid).
"""
