"""Per-call side of vgraph: padding rules, compiled bucket graphs, and the runtime that routes each call."""
