"""Per-call side of vgraph: validate, choose a bucket, fill its buffers, replay, narrow, copy out."""
