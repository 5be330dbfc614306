"""Sample models for the demo, the tests and the benchmarks, with random weights (nothing is downloaded).

- ``packed_vit``: reference encoders written against ``vgraph_compile.varlen_attention`` (a packed ViT, windows,
  CLS and register rows); ``explain_factories``: them with example inputs, for ``vgraph explain --module``.
- ``qwen_towers``: the Qwen vision towers at released or test sizes; ``qwen_vlms``: whole Qwen VLMs and their
  requests (real photographs, a video clip) through transformers' processors.
- ``vision_utils_towers``: every ``transformers.vision_utils`` family's tower, found by reading transformers;
  ``vision_utils_vlms``: those families' whole VLMs; ``tile_vlms``: a fixed-tile VLM (InternVL3).

Where a family is actually handled: ``hf/interface/packed_tower``, ``hf/interface/metadata_plan`` and ``analyze/tile_rows``.
"""
